// The API key of the console's pages: kept in this tab's session storage, sent as a bearer token, asked
// for with a form the pages share (shown when the server answers 401).
"use strict";

const ConsoleKey = (() => {
  const STORE = "mm-serve-api-key";
  let key = sessionStorage.getItem(STORE) || "";
  let form = null;

  function build(onKey) {
    form = document.createElement("form");
    form.id = "key-form";
    form.className = "keyform hidden";
    form.innerHTML = '<strong>API key</strong><span id="key-reason" class="muted"></span>'
      + '<input id="api-key" type="password" autocomplete="off" placeholder="the server\'s --api-key">'
      + '<button class="primary" type="submit">Use this key</button>'
      + '<span class="muted">Kept in this tab only (session storage), sent as <code>Authorization: Bearer</code>.</span>';
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      key = form.querySelector("#api-key").value.trim();
      sessionStorage.setItem(STORE, key);
      onKey();
    });
    document.querySelector("header").after(form);
  }

  return {
    // Headers for a call: the bearer token when a key is set, plus `extra`.
    headers(extra) { return Object.assign(key ? {Authorization: "Bearer " + key} : {}, extra || {}); },
    // Hide `app`, show the form with `reason`; `onKey` runs once a key is entered.
    ask(app, reason, onKey) {
      if (!form) build(onKey);
      app.classList.add("hidden");
      form.classList.remove("hidden");
      form.querySelector("#key-reason").textContent = reason + "";
      form.querySelector("#api-key").focus();
    },
    // Whether a key is set (for the reason shown on a 401).
    get set() { return key !== ""; },
    // The key was taken: hide the form, show `app`.
    accepted(app) {
      if (form) form.classList.add("hidden");
      app.classList.remove("hidden");
    },
  };
})();
