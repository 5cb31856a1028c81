// mm-serve playground: a chat page that speaks /v1/chat/completions like any OpenAI client (streamed),
// with images (picked, pasted or dropped), the call's settings, and per reply its TTFT, tokens/s, prompt
// and cached tokens and tier. Refusals (400, 429) show as messages. The API key, when the server needs
// one, is kept in this tab's session storage.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {info: null, messages: [], pending: [], busy: false};
const headers = () => ConsoleKey.headers({"Content-Type": "application/json"});
const askForKey = (reason) => ConsoleKey.ask($("app"), reason, loadInfo);

async function loadInfo() {
  let r;
  try {
    r = await fetch("/internal/console", {headers: headers()});
  } catch (err) {
    askForKey("The server could not be reached: " + err.message);
    return;
  }
  if (r.status === 401) {
    askForKey(ConsoleKey.set ? "That key was not accepted." : "This server needs an API key.");
    return;
  }
  state.info = await r.json();
  ConsoleKey.accepted($("app"));
  $("model").textContent = state.info.model + (state.info.vision ? "" : " (text only)");
  const tier = $("tier");
  for (const name of state.info.tiers) tier.add(new Option(name, name));
  $("detail-label").classList.toggle("hidden", !state.info.detail);
  $("attach-label").classList.toggle("hidden", !state.info.vision);
  $("question").placeholder = state.info.vision ? "Ask something. Paste, drop or attach images." : "Ask something.";
  $("question").focus();
}

// ---- images -------------------------------------------------------------------------------------

function addImages(files) {
  if (!state.info || !state.info.vision) return;
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => { state.pending.push(reader.result); drawThumbs(); };
    reader.readAsDataURL(file);
  }
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
                stream_options: {include_usage: true}, max_tokens: Number($("max-tokens").value),
                temperature: Number($("temperature").value)};
  if ($("seed").value !== "") body.seed = Number($("seed").value);
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
  const div = bubble("assistant", "");
  const out = div.querySelector(".text");
  const started = performance.now();
  let first = null, usage = null, tier = null, reply = "", failed = null;
  try {
    const response = await fetch("/v1/chat/completions", {method: "POST", headers: headers(),
                                                          body: JSON.stringify(callBody())});
    if (!response.ok) {
      state.messages.pop();  // not answered: the next question goes without it
      await showRefusal(div, response);
      return;
    }
    await readEvents(response, (chunk) => {
      if (chunk.error) { failed = chunk.error.message; return; }
      tier = chunk.service_tier || tier;
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = (choice.delta && choice.delta.content) || "";
        if (piece && first === null) first = performance.now();
        reply += piece;
        out.textContent = reply;
      }
    });
    const ended = performance.now();
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
    div.classList.add("failure");
    out.textContent = "The server could not be reached: " + err.message;
    state.messages.pop();
  } finally {
    div.dataset.done = "1";
    state.busy = false;
    $("send").disabled = false;
  }
}

$("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
$("question").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); send(); }
});
$("new-chat").addEventListener("click", () => {
  state.messages = [];
  $("conversation").replaceChildren();
});

loadInfo();
