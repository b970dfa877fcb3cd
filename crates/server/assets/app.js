"use strict";
let session = null;
let live = null;

function line(cls, text) {
  const div = document.createElement("div");
  div.className = cls;
  div.textContent = text;
  document.getElementById("log").appendChild(div);
  return div;
}

function status(text) {
  document.getElementById("status").textContent = text;
}

// Characters that change how text around them is shown without being seen
// themselves: controls (but new lines and tabs), bidirectional overrides
// and isolates, zero-width and other format characters, line and paragraph
// separators.
const HIDDEN = /(?![\n\t])[\p{Cc}\p{Cf}\p{Zl}\p{Zp}]/gu;

function codePoint(ch) {
  return "U+" + ch.codePointAt(0).toString(16).toUpperCase().padStart(4, "0");
}

// `text` with every hidden character written as its code point, as plain
// text (for lines of the log).
function visible(text) {
  return String(text).replace(HIDDEN, (ch) => "\\u{" + codePoint(ch).slice(2) + "}");
}

// Fills `element` with `text`, every hidden character shown as a marked
// code point: what the user approves is exactly what is shown, never
// reordered or hidden by the characters themselves.
function showVisibly(element, text) {
  element.replaceChildren();
  let at = 0;
  for (const match of String(text).matchAll(HIDDEN)) {
    element.append(text.slice(at, match.index));
    const mark = document.createElement("span");
    mark.className = "escaped";
    mark.textContent = "\\u{" + codePoint(match[0]).slice(2) + "}";
    mark.title = codePoint(match[0]);
    element.append(mark);
    at = match.index + match[0].length;
  }
  element.append(String(text).slice(at));
}

async function ensureSession() {
  if (session === null) {
    const response = await fetch("/sessions", { method: "POST" });
    session = (await response.json()).id;
    document.body.dataset.session = session;
  }
  return session;
}

function items(message) {
  if (typeof message.items === "string") return [{ type: "text", text: message.items }];
  return Array.isArray(message.items) ? message.items : [];
}

function render(step) {
  for (const message of step.messages) {
    for (const item of items(message)) {
      // The user's own words are shown when sent.
      if (message.role === "user" && item.type === "text") continue;
      if (item.type === "text" && item.text) line(message.role, message.role + ": " + visible(item.text));
      else if (item.type === "tool_use") line("tool", "calls " + item.name + " " + visible(JSON.stringify(item.input)));
      else if (item.type === "tool_result") line("result", "result: " + visible(item.content));
    }
  }
  if (step.yield_reason === "awaiting_approval") {
    const n = (step.approvals || []).length;
    line("waiting", "waiting for your decision on " + n + " tool call" + (n === 1 ? "" : "s"));
  }
}

function handle(block) {
  let event = "message";
  let data = "";
  for (const l of block.split("\n")) {
    if (l.startsWith("event:")) event = l.slice(6).trim();
    else if (l.startsWith("data:")) data += l.slice(5).trim();
  }
  if (event === "delta") {
    // Text as the model writes it; its step replaces it.
    if (live === null) live = line("assistant live", "assistant: ");
    live.textContent += visible(JSON.parse(data).text);
  } else if (event === "step") {
    if (live !== null) { live.remove(); live = null; }
    render(JSON.parse(data));
  } else if (event === "decided") {
    const decided = JSON.parse(data);
    line("decision", decided.decision + ": " + decided.tool + (decided.waiting ? " (" + decided.waiting + " still waiting)" : ""));
  } else if (event === "error") line("error", "error: " + data);
}

// Reads a response's server-sent events as they arrive (the body of a POST).
async function readEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      handle(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
    }
  }
}

async function failed(response) {
  let text = response.statusText;
  try { text = (await response.json()).error; } catch (_) { /* not JSON */ }
  line("error", "error: " + text);
}

async function send(text) {
  const id = await ensureSession();
  status("running");
  const response = await fetch("/sessions/" + id + "/messages", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ text }),
  });
  if (response.ok) await readEvents(response);
  else await failed(response);
  await refreshApprovals();
  status("idle");
}

async function decide(request, body) {
  status("running");
  const response = await fetch("/sessions/" + session + "/approvals/" + encodeURIComponent(request.request_id), {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  if (response.ok) await readEvents(response);
  else await failed(response);
  await refreshApprovals();
  status("idle");
}

function button(text, cls, onclick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = text;
  b.className = cls;
  b.onclick = onclick;
  return b;
}

function approvalBox(request) {
  const box = document.createElement("div");
  box.className = "approval";
  box.dataset.request = request.request_id;
  const title = document.createElement("h2");
  title.append("Approve ");
  const tool = document.createElement("code");
  showVisibly(tool, request.tool);
  title.append(tool, "?");
  const args = document.createElement("pre");
  args.className = "args";
  showVisibly(args, JSON.stringify(request.args, null, 2));
  const preview = document.createElement("div");
  preview.className = "preview";
  showVisibly(preview, request.preview);
  const meta = document.createElement("div");
  meta.className = "meta";
  meta.textContent = "expires " + new Date(request.expires).toLocaleTimeString();
  const actions = document.createElement("div");
  actions.className = "actions";
  actions.append(button("approve", "approve", () => decide(request, { decision: "approve" })));
  const paused = Boolean(request.call_id);
  if (paused) actions.append(button("edit", "edit", () => box.classList.toggle("editing")));
  const reason = document.createElement("input");
  reason.className = "deny-message";
  reason.placeholder = "reason for the model (optional)";
  reason.setAttribute("aria-label", "reason for denying");
  actions.append(reason);
  actions.append(button("deny", "deny", () => {
    const message = reason.value.trim();
    decide(request, message ? { decision: "deny", message } : { decision: "deny" });
  }));
  box.append(title, args, preview, meta, actions);
  if (paused) {
    const editor = document.createElement("div");
    editor.className = "editor";
    const area = document.createElement("textarea");
    area.className = "edit-args";
    area.setAttribute("aria-label", "edited arguments (JSON)");
    area.value = JSON.stringify(request.args, null, 2);
    editor.append(area, button("approve edited", "approve-edited", () => {
      let edited;
      try { edited = JSON.parse(area.value); } catch (e) { line("error", "error: the arguments are not JSON: " + e.message); return; }
      decide(request, { decision: "edit", args: edited });
    }));
    box.append(editor);
  }
  return box;
}

async function refreshApprovals() {
  const box = document.getElementById("approvals");
  if (session === null) { box.replaceChildren(); return; }
  const response = await fetch("/sessions/" + session + "/approvals");
  const pending = response.ok ? await response.json() : [];
  box.replaceChildren(...pending.map(approvalBox));
}

document.getElementById("form").onsubmit = (event) => {
  event.preventDefault();
  const input = document.getElementById("text");
  const text = input.value.trim();
  if (!text) return;
  input.value = "";
  line("user", "you: " + visible(text));
  send(text);
};

// Signing in: the page asks who it is; without a sign-in it shows the key
// form, and a key exchanged for the service's cookie shows the chat.
async function whoAmI() {
  const response = await fetch("/me");
  const signedIn = response.ok;
  document.getElementById("signin").hidden = signedIn;
  document.getElementById("form").hidden = !signedIn;
  if (signedIn) {
    const me = await response.json();
    document.body.dataset.principal = me.principal;
    status("idle");
  } else {
    status("sign in with an API key");
  }
}

document.getElementById("signin").onsubmit = async (event) => {
  event.preventDefault();
  const input = document.getElementById("key");
  const response = await fetch("/auth/session", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ key: input.value.trim() }),
  });
  input.value = "";
  const error = document.getElementById("signin-error");
  if (response.ok) {
    error.textContent = "";
    await whoAmI();
  } else {
    const body = await response.json().catch(() => ({}));
    error.textContent = body.error || ("sign-in failed: " + response.status);
  }
};

whoAmI();
