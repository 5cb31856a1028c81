// mm-serve playground: a chat page that speaks /v1/chat/completions like any OpenAI client (streamed),
// with images (picked, pasted or dropped), the call's settings, and per reply its TTFT, tokens/s, prompt
// and cached tokens and tier. Refusals (400, 429) show as messages. The API key, when the server needs
// one, is kept in this tab's session storage.
"use strict";

const $ = (id) => document.getElementById(id);
const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp"];  // what the server decodes
const RETRY_MS = 2000;
const OUR_TIER = {priority: "interactive", default: "standard", flex: "batch"};  // OpenAI's service_tier names → the tiers
// conversation: bumped by New chat, so a reply still streaming for an earlier one is dropped, not carried over
const state = {info: null, messages: [], pending: [], busy: false, conversation: 0, inflight: null};
const headers = () => ConsoleKey.headers({"Content-Type": "application/json"});
const askForKey = (reason) => ConsoleKey.ask($("app"), reason, loadInfo);

function notice(text) {
  let box = $("notice");
  if (!box) {
    box = document.createElement("p");
    box.id = "notice";
    box.className = "keyform";
    document.querySelector("header").after(box);
  }
  box.textContent = text;
  box.classList.toggle("hidden", !text);
}

async function loadInfo() {
  let r, info = null;
  try {
    r = await fetch("/internal/console", {headers: headers()});
    if (r.ok) info = await r.json();
  } catch (err) {
    notice("The server could not be reached (" + err.message + "); trying again.");
    setTimeout(loadInfo, RETRY_MS);
    return;
  }
  if (r.status === 401) {
    notice("");
    askForKey(ConsoleKey.set ? "That key was not accepted." : "This server needs an API key.");
    return;
  }
  if (!info || !Array.isArray(info.tiers)) {
    notice("The server answered " + r.status + " " + r.statusText + "; trying again.");
    setTimeout(loadInfo, RETRY_MS);
    return;
  }
  notice("");
  state.info = info;
  ConsoleKey.accepted($("app"));
  $("model").textContent = state.info.model + (state.info.vision ? "" : " (text only)");
  const tier = $("tier");
  tier.replaceChildren(new Option("auto", "auto"));
  for (const name of state.info.tiers) tier.add(new Option(name, name));
  $("detail-label").classList.toggle("hidden", !state.info.detail);
  $("attach-label").classList.toggle("hidden", !state.info.vision);
  $("question").placeholder = state.info.vision ? "Ask something. Paste, drop or attach images." : "Ask something.";
  $("question").focus();
}

// ---- images -------------------------------------------------------------------------------------

const readAsDataURL = (file) => new Promise((resolve, reject) => {
  const reader = new FileReader();
  reader.onload = () => resolve(reader.result);
  reader.onerror = () => reject(reader.error);
  reader.readAsDataURL(file);
});

// Images in the order they were chosen (each read whole before the next is added).
async function addImages(files) {
  if (!state.info || !state.info.vision) return;
  const chosen = [...files].filter((file) => IMAGE_TYPES.includes(file.type));
  const skipped = files.length - chosen.length;
  notice(skipped ? skipped + " file(s) left out: the server takes PNG, JPEG, WebP, GIF and BMP images." : "");
  for (const url of await Promise.all(chosen.map(readAsDataURL))) state.pending.push(url);
  drawThumbs();
}

function drawThumbs() {
  const box = $("thumbs");
  box.replaceChildren();
  state.pending.forEach((url, i) => {
    const fig = document.createElement("figure");
    const img = document.createElement("img");
    img.src = url;
    const drop = document.createElement("button");
    drop.type = "button";
    drop.textContent = "x";
    drop.title = "remove";
    drop.onclick = () => { state.pending.splice(i, 1); drawThumbs(); };
    fig.append(img, drop);
    box.append(fig);
  });
}

$("attach").addEventListener("change", (event) => { addImages(event.target.files); event.target.value = ""; });
document.addEventListener("paste", (event) => {
  const files = [...event.clipboardData.items].filter((i) => i.kind === "file").map((i) => i.getAsFile());
  if (files.length) { event.preventDefault(); addImages(files); }
});
const composer = $("composer");
composer.addEventListener("dragover", (event) => { event.preventDefault(); composer.classList.add("dragging"); });
composer.addEventListener("dragleave", () => composer.classList.remove("dragging"));
composer.addEventListener("drop", (event) => {
  event.preventDefault();
  composer.classList.remove("dragging");
  addImages(event.dataTransfer.files);
});

// ---- the conversation -----------------------------------------------------------------------------

function bubble(role, text, images) {
  const div = document.createElement("div");
  div.className = "message " + role;
  for (const url of images || []) {
    const img = document.createElement("img");
    img.src = url;
    div.append(img);
  }
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  div.append(body);
  $("conversation").append(div);
  div.scrollIntoView({block: "end"});
  return div;
}

function showStats(div, stats) {
  const box = document.createElement("div");
  box.className = "stats";
  for (const [name, value] of Object.entries(stats)) {
    if (value === null || value === undefined) continue;
    const span = document.createElement("span");
    span.dataset.stat = name;
    span.textContent = name + " " + value;
    box.append(span);
  }
  div.append(box);
}

async function showRefusal(div, response) {
  let message = response.statusText;
  try {
    const body = await response.json();
    message = (body.error && body.error.message) || message;
  } catch (err) { /* not JSON: keep the status text */ }
  div.dataset.status = String(response.status);
  if (response.status === 429) {
    const retry = response.headers.get("Retry-After");
    div.classList.add("refusal");
    div.querySelector(".text").textContent = "The service is busy and turned this request away"
      + (retry ? "; try again in " + retry + " s" : "") + ". " + message;
  } else if (response.status === 400) {
    div.classList.add("refusal");
    div.querySelector(".text").textContent = "The request was refused: " + message;
  } else if (response.status === 401) {
    div.classList.add("failure");
    div.querySelector(".text").textContent = "The API key was not accepted.";
    askForKey("The API key was not accepted.");
  } else {
    div.classList.add("failure");
    div.querySelector(".text").textContent = "Error " + response.status + ": " + message;
  }
}

function callBody() {
  const body = {model: state.info.model, messages: state.messages, stream: true,
                stream_options: {include_usage: true}};
  for (const [field, id] of [["max_tokens", "max-tokens"], ["temperature", "temperature"], ["seed", "seed"]]) {
    if ($(id).value.trim() !== "") body[field] = Number($(id).value);  // empty: the server's default
  }
  if ($("tier").value !== "auto") body.service_tier = $("tier").value;
  return body;
}

// Read an SSE body: calls onEvent with each parsed `data:` payload (not "[DONE]").
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ") && line !== "data: [DONE]") onEvent(JSON.parse(line.slice(6)));
      }
    }
  }
}

async function send() {
  const text = $("question").value.trim();
  if (state.busy || !state.info || (!text && !state.pending.length)) return;
  const images = state.pending.splice(0);
  const detail = $("detail").value;
  const parts = images.map((url) => ({type: "image_url", image_url: detail ? {url, detail} : {url}}));
  if (text) parts.push({type: "text", text});
  state.messages.push({role: "user", content: images.length ? parts : text});
  bubble("user", text, images);
  $("question").value = "";
  drawThumbs();
  state.busy = true;
  $("send").disabled = true;
  const conversation = state.conversation;
  const controller = new AbortController();
  state.inflight = controller;
  const div = bubble("assistant", "");
  const out = div.querySelector(".text");
  const started = performance.now();
  let first = null, usage = null, tier = null, reply = "", failed = null;
  const giveBack = () => {  // not answered: the question goes back to the composer, out of the conversation
    state.messages.pop();
    if (!$("question").value) $("question").value = text;
    state.pending.unshift(...images);
    drawThumbs();
  };
  try {
    const response = await fetch("/v1/chat/completions", {method: "POST", headers: headers(),
                                                          body: JSON.stringify(callBody()), signal: controller.signal});
    if (!response.ok) {
      giveBack();
      await showRefusal(div, response);
      return;
    }
    await readEvents(response, (chunk) => {
      if (chunk.error) { failed = chunk.error.message; return; }
      tier = OUR_TIER[chunk.service_tier] || chunk.service_tier || tier;  // responses name OpenAI's tiers
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = (choice.delta && choice.delta.content) || "";
        if (piece && first === null) first = performance.now();
        reply += piece;
        out.textContent = reply;
      }
    });
    const ended = performance.now();
    if (conversation !== state.conversation) return;  // New chat was clicked meanwhile
    if (failed !== null) {
      div.classList.add("failure");
      out.textContent = reply + "\n[the request failed: " + failed + "]";
    }
    state.messages.push({role: "assistant", content: reply});
    const tokens = usage ? usage.completion_tokens : null;
    const details = usage && usage.prompt_tokens_details;
    showStats(div, {
      "TTFT": first === null ? null : Math.round(first - started) + " ms",
      "tokens/s": tokens > 1 && first !== null && ended > first ? ((tokens - 1) / ((ended - first) / 1000)).toFixed(1) : null,
      "prompt": usage ? usage.prompt_tokens + " tokens" : null,
      "cached": details ? details.cached_tokens + " tokens" : null,
      "output": tokens === null ? null : tokens + " tokens",
      "tier": tier,
    });
  } catch (err) {
    if (conversation !== state.conversation) return;
    div.classList.add("failure");
    out.textContent = reply ? reply + "\n[the connection broke while the answer streamed: " + err.message + "]"
      : "The server could not be reached: " + err.message;
    giveBack();
  } finally {
    div.dataset.done = "1";
    if (state.inflight === controller) {
      state.inflight = null;
      state.busy = false;
      $("send").disabled = false;
    }
  }
}

$("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
$("question").addEventListener("keydown", (event) => {
  if (event.isComposing || event.keyCode === 229) return;  // Enter that ends an IME composition
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); send(); }
});
$("new-chat").addEventListener("click", () => {
  state.conversation += 1;
  if (state.inflight) state.inflight.abort();  // its reply belongs to the conversation left behind
  state.inflight = null;
  state.busy = false;
  $("send").disabled = false;
  state.messages = [];
  $("conversation").replaceChildren();
});

loadInfo();
