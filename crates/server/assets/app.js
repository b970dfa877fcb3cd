"use strict";
// The chat page: signs in with an API key, lists the principal's chats,
// shows one conversation (restored from the server on reload, joining its
// running turn), streams turns, shows tool calls as cards and calls that
// wait for approval as forms, and stops a running turn.
//
// Nothing the model or a tool writes is ever made markup here: their text
// is set as text, and an assistant's markdown arrives rendered and
// sanitized by the server (`html`), which is the one thing inserted as
// HTML. Characters that would reorder or hide text are shown as marked
// code points.

const $ = (id) => document.getElementById(id);

// What the page holds of the open chat.
const state = {
  session: null,       // the open chat's id (null: a new chat, created on its first message)
  running: false,      // a turn streams
  generation: 0,       // bumped when another chat opens: a stream of the old one stops rendering
  controller: null,    // aborts the stream being read
  lastEventId: null,   // of the stream being read, to take it up again
  echo: null,          // the text just sent, shown at once: its step does not show it again
  echoNode: null,
  live: null,          // the assistant's text as it is written
  liveThinking: null,  // its thinking as it is written
  pendingDelta: "",
  unkept: false,       // the last turn was stopped with its answer half written
  cards: new Map(),    // tool call id -> its card
  waiting: 0,          // calls waiting for a decision
  target: null,        // where messages are appended (a fragment while a history renders)
  agent: null,
  answeredBy: null,    // the model that answered the step being shown, if it said
  speaker: null,       // in a team's chat: the agent whose messages are being shown
};

// Past this many characters a text is shown cut, with a button for the rest.
const SHOWN = 4000;

// ---- Text, made visible --------------------------------------------------------

// Characters that change how text around them is shown without being seen
// themselves: controls (but new lines and tabs), bidirectional overrides
// and isolates, zero-width and other format characters, line and
// paragraph separators. STRICT is for what a user approves and a tool's
// arguments; PROSE leaves the joiners that build emoji and join letters.
const STRICT = /(?![\n\t])[\p{Cc}\p{Cf}\p{Zl}\p{Zp}]/gu;
const PROSE = /(?![\n\t\u200C\u200D])[\p{Cc}\p{Cf}\p{Zl}\p{Zp}]/gu;

function codePoint(ch) {
  return ch.codePointAt(0).toString(16).toUpperCase().padStart(4, "0");
}

// Appends `text` to `element` as text, each hidden character as a marked
// `\u{…}`: what is shown is exactly what was written, never reordered.
function appendVisibly(element, text, pattern = STRICT) {
  text = String(text);
  let at = 0;
  for (const match of text.matchAll(pattern)) {
    if (match.index > at) element.append(text.slice(at, match.index));
    const mark = document.createElement("span");
    mark.className = "escaped";
    mark.textContent = "\\u{" + codePoint(match[0]) + "}";
    mark.title = "U+" + codePoint(match[0]);
    element.append(mark);
    at = match.index + match[0].length;
  }
  if (at < text.length) element.append(text.slice(at));
}

function showVisibly(element, text, pattern = STRICT) {
  element.replaceChildren();
  appendVisibly(element, text, pattern);
}

// Shows `text` in `element`, cut at SHOWN characters with a button that
// shows the rest: a megabyte of output costs nothing until asked for.
function showLong(element, text, pattern = STRICT) {
  text = String(text);
  if (text.length <= SHOWN) {
    showVisibly(element, text, pattern);
    return;
  }
  showVisibly(element, text.slice(0, SHOWN) + "\n…", pattern);
  const more = button("Show all " + size(text), "more", () => {
    showVisibly(element, text, pattern);
    more.remove();
  });
  element.after(more);
}

function size(text) {
  const n = text.length;
  if (n < 10000) return n + " characters";
  if (n < 1000000) return Math.round(n / 1000) + " thousand characters";
  return (n / 1000000).toFixed(1) + " million characters";
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(text, className, onclick) {
  const b = el("button", className, text);
  b.type = "button";
  b.onclick = onclick;
  return b;
}

// ---- The conversation ------------------------------------------------------------

const scroller = () => $("conversation");

// Runs `change`, then keeps the conversation scrolled to its end if it was
// there (a user who scrolled up to read stays where they are).
function follow(change) {
  const s = scroller();
  const atEnd = s.scrollHeight - s.scrollTop - s.clientHeight < 80;
  const result = change();
  if (atEnd) s.scrollTop = s.scrollHeight;
  return result;
}

function toEnd() {
  const s = scroller();
  s.scrollTop = s.scrollHeight;
}

function append(node) {
  $("empty").hidden = true;
  (state.target || $("log")).append(node);
  return node;
}

function note(text) {
  return follow(() => append(el("div", "note", text)));
}

function showError(title, detail) {
  return follow(() => {
    const box = el("div", "error");
    box.setAttribute("role", "alert");
    box.append(el("strong", "", title));
    if (detail) {
      const d = el("div", "detail");
      showLong(d, detail, PROSE);
      box.append(d);
    }
    return append(box);
  });
}

function userMessage(text) {
  const node = el("div", "msg user");
  appendVisibly(node, text, PROSE);
  return append(node);
}

// What markov itself told the model (a reminder it injected, such as the
// one after a cut answer, a follow-up asking again, a resume notice) or
// handed it from an agent instance: markov's note, never the user's bubble.
function markovNote(text, who = "markov to the model") {
  const node = el("div", "msg markov");
  node.append(el("span", "who", who));
  const body = el("div", "said");
  appendVisibly(body, text, PROSE);
  node.append(body);
  return append(node);
}

// An assistant's text: the server's sanitized rendering of its markdown,
// or the plain text when there is none (too long to render).
function assistantMessage(text, html) {
  const node = el("div", "msg assistant");
  if (typeof html === "string") {
    // Rendered and sanitized on the server (pulldown-cmark, ammonia): only
    // formatting tags, http(s) and mailto links, no attribute of the
    // model's; the page's policy runs no script but its own.
    node.innerHTML = html;
    for (const pre of node.querySelectorAll("pre")) {
      const frame = el("div", "code");
      pre.replaceWith(frame);
      frame.append(pre);
      if (navigator.clipboard) {
        const copy = button("Copy", "copy", () => {
          navigator.clipboard.writeText(pre.innerText).then(() => {
            copy.textContent = "Copied";
            setTimeout(() => { copy.textContent = "Copy"; }, 1200);
          }, () => { copy.textContent = "Cannot copy"; });
        });
        frame.append(copy);
      }
    }
  } else {
    node.classList.add("plain");
    showLong(node, text, PROSE);
  }
  // A tooltip, never markup: which model wrote it (a fallback's may differ).
  if (state.answeredBy) node.title = "Answered by " + visibleName(state.answeredBy);
  // In a team's chat, the agent that wrote it.
  if (state.speaker) {
    const who = el("span", "who");
    appendVisibly(who, state.speaker);
    node.prepend(who);
    node.classList.add("by-agent");
  }
  return append(node);
}

// The mark that ends a thinking part a guard blocked partway: what was
// streamed of it is shown, then that the rest was withheld.
const WITHHELD = "[guard] The rest of this thinking was withheld.";

function thinking(text) {
  const withheld = text.endsWith(WITHHELD);
  if (withheld) text = text.slice(0, -WITHHELD.length).trimEnd();
  const box = el("details", "msg thinking");
  box.append(el("summary", "", withheld ? "Thinking (partly withheld by a guard)" : "Thinking"));
  const body = el("div");
  if (text) showLong(body, text, PROSE);
  box.append(body);
  if (withheld) {
    box.classList.add("withheld");
    box.append(el("p", "withheld", "The rest of this thinking was withheld by a guard."));
  }
  return append(box);
}

// Thinking as it is written: an open box the step's message replaces.
function thinkingDelta(text) {
  if (state.liveThinking === null) {
    state.liveThinking = follow(() => {
      const box = thinking("");
      box.open = true;
      box.classList.add("live");
      return box;
    });
  }
  const body = state.liveThinking.querySelector("div");
  follow(() => appendVisibly(body, text, PROSE));
}

// `key: value, …` of a call's arguments, for a card's one line.
function brief(input) {
  if (input === null || typeof input !== "object" || Array.isArray(input)) return JSON.stringify(input);
  return Object.entries(input)
    .map(([k, v]) => k + ": " + (typeof v === "string" ? v : JSON.stringify(v)))
    .join(", ");
}

function clip(text, n) {
  text = String(text);
  return text.length > n ? text.slice(0, n) + "…" : text;
}

function part(label, text) {
  const box = el("div", "part");
  box.append(el("div", "label", label));
  const pre = el("pre");
  box.append(pre);
  showLong(pre, text, STRICT);
  return box;
}

// A card for a tool call: its name and arguments on one line, opening to
// the arguments in full and, once it arrives, the result.
function toolCard(id, name, input) {
  const card = el("details", "tool");
  card.dataset.call = id;
  const summary = el("summary");
  const title = el("code", "name");
  appendVisibly(title, name);
  const line = el("span", "brief");
  appendVisibly(line, clip(brief(input), 160));
  const status = el("span", "state", "running");
  summary.append(title, line, status);
  card.append(summary, part("Arguments", JSON.stringify(input, null, 2)));
  state.cards.set(id, card);
  return append(card);
}

// What a tool result says: the registry's envelopes (`{"ok": true,
// "data": …}`, `{"ok": false, "error": {"type", "message"}}`) read as
// their data or their error, other JSON pretty, text as it is.
function readResult(content, isError) {
  let value;
  try { value = JSON.parse(content); } catch (_) { value = undefined; }
  const pretty = (v) => (typeof v === "string" ? v : JSON.stringify(v, null, 2));
  if (value && typeof value === "object" && !Array.isArray(value) && typeof value.ok === "boolean") {
    if (value.ok) return { ok: true, text: pretty(value.data) };
    const error = value.error || {};
    return { ok: false, kind: error.type, text: error.message ? String(error.message) : pretty(error) };
  }
  if (value !== undefined && typeof value === "object" && value !== null) {
    return { ok: !isError, text: pretty(value) };
  }
  return { ok: !isError, text: String(content) };
}

// The raster types a thumbnail shows; any other image is named only.
const THUMBNAIL_TYPES = ["image/png", "image/jpeg", "image/gif", "image/webp"];

// A tool result's images: a thumbnail each, or "an image (type, size)".
function resultImages(images) {
  const shown = el("div", "part images");
  for (const image of Array.isArray(images) ? images : []) {
    const type = String(image.mimeType || "");
    const data = String(image.data || "");
    const bytes = Math.floor((data.replace(/=+$/, "").length * 3) / 4);
    const name = "an image (" + type + ", " + bytes + " bytes)";
    if (THUMBNAIL_TYPES.includes(type) && /^[A-Za-z0-9+/]+=*$/.test(data)) {
      const img = el("img", "thumb");
      img.src = "data:" + type + ";base64," + data;
      img.alt = name;
      img.title = name;
      shown.append(img);
    } else {
      shown.append(el("div", "label", name));
    }
  }
  return shown;
}

function toolResult(id, content, isError, images) {
  let card = state.cards.get(id);
  if (!card) card = toolCard(id, "tool", {});
  const result = readResult(content, isError === true);
  card.classList.add(result.ok ? "ok" : "failed");
  const status = card.querySelector(".state");
  status.textContent = result.ok ? "done" : "error" + (result.kind ? ": " + result.kind.toLowerCase().replaceAll("_", " ") : "");
  const old = card.querySelector(".part.result");
  if (old) old.remove();
  const shown = part(result.ok ? "Result" : "Error", result.text);
  shown.classList.add("result");
  if (Array.isArray(images) && images.length > 0) shown.append(resultImages(images));
  card.append(shown);
  const line = card.querySelector(".brief");
  line.append(" → ");
  const count = Array.isArray(images) ? images.length : 0;
  const first = result.text.split("\n")[0] || (count > 0 ? count + (count === 1 ? " image" : " images") : "");
  appendVisibly(line, clip(first, 80));
}

function itemsOf(message) {
  if (typeof message.items === "string") return [{ type: "text", text: message.items, html: message.html }];
  return Array.isArray(message.items) ? message.items : [];
}

// Whether a message is attributed to an agent instance: a user message so
// attributed was not written by the user.
function fromInstance(message) {
  const source = message.metadata && message.metadata.source;
  return Boolean(source && typeof source.instanceId === "string" && source.instanceId);
}

// Shows one message of the history or of a step.
function showMessage(message) {
  for (const item of itemsOf(message)) {
    if (message.role === "user") {
      if (item.type === "text" && item.text && fromInstance(message)) {
        // Text an agent instance handed back (a cede, a command's result):
        // its words, relayed by markov, never the user's.
        markovNote(item.text, "markov to the model, from an agent");
      } else if (item.type === "text" && item.text) {
        if (state.echo !== null && item.text === state.echo) {
          // The text the user sent, shown when sent: once is enough.
          state.echo = null;
          state.echoNode = null;
          continue;
        }
        if (state.echo !== null && state.echoNode) {
          // The text sent came back otherwise: an input guard rewrote it
          // (a redaction). The bubble shows what the conversation keeps.
          const sent = state.echoNode;
          sent.replaceChildren();
          appendVisibly(sent, item.text, PROSE);
          sent.classList.add("rewritten");
          sent.title = "rewritten by a guard";
          retitle(state.session, state.echo, item.text);
          state.echo = null;
          state.echoNode = null;
          continue;
        }
        userMessage(item.text);
        remember(state.session, item.text);
      } else if (item.type === "tool_result") {
        toolResult(item.tool_use_id, item.content, item.is_error, item.images);
      }
    } else if (message.role === "assistant") {
      if (item.type === "text" && item.text) assistantMessage(item.text, item.html);
      else if (item.type === "tool_use") toolCard(item.id, item.name, item.input);
      else if (item.type === "thinking" && item.thinking) thinking(item.thinking);
      else if (item.type === "output") assistantMessage(JSON.stringify(item.data, null, 2));
    } else if (message.role === "system") {
      // A guard's block is markov's note too, shown as a block.
      if (item.type === "text" && item.text && item.text.startsWith("[guard] ")) {
        if (state.echo !== null && state.echoNode) {
          // The message sent never entered the conversation: the note
          // takes its bubble's place, as it does in the history.
          state.echoNode.remove();
          retitle(state.session, state.echo, null);
          state.echo = null;
          state.echoNode = null;
        }
        markovNote(item.text.slice(8), "blocked by a guard").classList.add("blocked");
      } else if (item.type === "text" && item.text) markovNote(item.text);
    }
  }
}

function showStep(step) {
  state.answeredBy = typeof step.model === "string" ? step.model : null;
  follow(() => {
    let answered = false;
    // In a team's chat, what a handoff gave the agent taking over (the
    // conversation so far, the reason): markov's words to it, never the
    // user's nor the agent's.
    const given = step.handoff_context || 0;
    for (const [i, message] of (step.messages || []).entries()) {
      if (i < given) {
        for (const item of itemsOf(message)) {
          if (item.type === "text" && item.text) {
            markovNote(item.text, "markov to " + (state.speaker || "the agent") + ", with the handoff");
          }
        }
        continue;
      }
      showMessage(message);
      answered ||= message.role === "assistant" && itemsOf(message).some((i) => i.type === "text" && i.text);
    }
    // A terminal tool's output is the answer.
    if (step.response && !answered) assistantMessage(step.response, step.response_html);
  });
  state.answeredBy = null;
  if (step.yield_reason === "awaiting_approval") showApprovals(step.approvals || []);
}

// ---- Text as it is written ---------------------------------------------------------

function delta(text) {
  if (state.live === null) {
    state.live = follow(() => append(el("div", "msg assistant live")));
  }
  // Painted once a frame, however many pieces arrive.
  if (state.pendingDelta === "") requestAnimationFrame(paintDelta);
  state.pendingDelta += text;
}

function paintDelta() {
  if (state.live === null || state.pendingDelta === "") return;
  const text = state.pendingDelta;
  state.pendingDelta = "";
  follow(() => appendVisibly(state.live, text, PROSE));
}

// The step that follows replaces the text written so far.
function endLive() {
  if (state.live !== null) state.live.remove();
  state.live = null;
  if (state.liveThinking !== null) state.liveThinking.remove();
  state.liveThinking = null;
  state.pendingDelta = "";
}

// ---- Runs ------------------------------------------------------------------------------

function setRunning(running) {
  state.running = running;
  const stop = $("stop");
  stop.hidden = !running;
  stop.disabled = false;
  stop.textContent = "Stop";
  document.body.classList.toggle("running", running);
  updateComposer();
}

function updateComposer() {
  const waiting = state.waiting > 0 && !state.running;
  $("send").disabled = state.running || waiting;
  const status = $("status");
  status.classList.toggle("busy", state.running);
  status.textContent = state.running
    ? "The agent is working…"
    : waiting
      ? "Waiting for your decision on the call above."
      : "";
}

// Handles one server-sent event; `true` when it ends the run's stream.
function handle(name, data) {
  let body = {};
  try { body = JSON.parse(data); } catch (_) { body = { error: data }; }
  switch (name) {
    case "delta":
      delta(body.text || "");
      return false;
    case "thinking":
      thinkingDelta(body.text || "");
      return false;
    case "step":
      if (body.yield_reason === "cancelled" && state.live !== null) {
        // What was written before the stop stays in view, marked as not
        // kept (the conversation goes on without it).
        state.live.classList.replace("live", "plain");
        state.live.classList.add("unkept");
        state.live.title = "stopped before the answer was complete: not kept";
        paintDelta();
        state.live = null;
        state.unkept = true;
      }
      endLive();
      state.speaker = typeof body.agent === "string" ? body.agent : null;
      showStep(body);
      state.speaker = null;
      return false;
    case "handoff":
      endLive();
      handoffNote(body);
      return false;
    case "decided": {
      const verbs = { approve: "approved", edit: "approved with edited arguments", deny: "denied", respond: "answered" };
      const waiting = body.waiting ? " (" + body.waiting + " more waiting)" : "";
      note("You " + (verbs[body.decision] || body.decision) + " the call of " + visibleName(body.tool) + "." + waiting);
      const box = document.querySelector('.approval[data-request="' + CSS.escape(body.request_id) + '"]');
      if (box) box.remove();
      state.waiting = document.querySelectorAll("#approvals .approval").length;
      // While other calls wait, no run resumes: the stream ends here.
      return body.waiting > 0;
    }
    case "done":
      endLive();
      if (body.stopped === "cancelled") {
        note(state.unkept ? "Stopped. The unfinished answer above is not kept." : "Stopped.");
      } else if (body.stopped === "deadline") note("Stopped: the turn took longer than the server allows.");
      else if (body.yield_reason === "loop_detected") note("Stopped: the model kept making the same call.");
      else if (body.yield_reason === "max_tokens") note("The answer was cut at the model's token limit.");
      else if (body.yield_reason === "context_exhausted") note("Stopped: the conversation no longer fits the model's context window. An agent without a context policy needs one; with one, this message alone is too long for the model. Nothing was lost.");
      else if (body.yield_reason === "blocked") note("Blocked by a guard: nothing it blocked was shown.");
      else if (body.yield_reason === "usage_limit") note("Stopped before the next model call: " + (body.usage_limit || "a usage limit would be passed") + ".");
      return true;
    case "interrupted":
      endLive();
      note("The server is restarting; the turn goes on when it is back.");
      reopenWhenBack();
      return true;
    case "error":
      endLive();
      showError("The turn failed", body.error || data);
      return true;
    default:
      return false;
  }
}

// One agent of a team handed the conversation to another.
function handoffNote(handoff) {
  return follow(() => {
    const node = el("div", "note handoff");
    appendVisibly(node, (handoff.from || "?") + " handed the conversation to " + (handoff.to || "?")
      + (handoff.reason ? ": " + handoff.reason : ""));
    return append(node);
  });
}

function visibleName(name) {
  return String(name).replace(STRICT, (ch) => "\\u{" + codePoint(ch) + "}");
}

// Reads a response's server-sent events as they arrive; `true` when the
// stream ended the run (`done`, `error`, `interrupted`).
async function readEvents(response, generation) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let ended = false;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    if (generation !== state.generation) { reader.cancel(); return true; }
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        else if (line.startsWith("id:")) state.lastEventId = line.slice(3).trim();
      }
      if (data.length) ended = handle(name, data.join("\n")) || ended;
    }
  }
  return ended;
}

async function errorOf(response) {
  let text = response.status + " " + response.statusText;
  try { text = (await response.json()).error || text; } catch (_) { /* not JSON */ }
  return text;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// One connection to a run's events: what became of it.
async function connect(start, generation, refused) {
  const controller = new AbortController();
  state.controller = controller;
  try {
    const response = await start(controller.signal);
    if (response.status === 401) return { kind: "signed out" };
    // No turn runs (any more): what it did is in the history.
    if (response.status === 204) return { kind: "gone" };
    if (!response.ok) {
      showError(refused, await errorOf(response));
      return { kind: "refused" };
    }
    return { kind: (await readEvents(response, generation)) ? "ended" : "dropped" };
  } catch (error) {
    if (controller.signal.aborted) return { kind: "aborted" };
    return { kind: "dropped", error };
  }
}

// Streams a run: `start` makes the request (a message, a decision, or the
// events of a running turn); `refused` titles the error of a request the
// server refuses. Returns what became of it: `ended` (read to the end of
// the run), `refused`, `dropped`, `gone`, `aborted` or `signed out`.
async function stream(start, refused) {
  const generation = state.generation;
  state.lastEventId = null;
  state.unkept = false;
  setRunning(true);
  let outcome = await connect(start, generation, refused);
  // The connection dropped mid-turn, but the turn goes on on the server:
  // take its stream up where it stopped (a few tries).
  for (let attempt = 1; outcome.kind === "dropped" && state.lastEventId !== null && attempt <= 3; attempt++) {
    await sleep(400 * attempt);
    if (generation !== state.generation) return "aborted";
    const last = state.lastEventId;
    outcome = await connect((signal) => fetch(eventsUrl(state.session), {
      headers: { "last-event-id": last }, signal,
    }), generation, "Cannot follow the turn");
  }
  if (generation !== state.generation) return outcome.kind;
  state.controller = null;
  setRunning(false);
  if (outcome.kind === "signed out") signedOut();
  else if (outcome.kind === "gone") await openSession(state.session, { keepScroll: true });
  else if (outcome.kind === "ended") afterRun();
  else if (outcome.kind === "dropped") {
    showError("Lost the connection to the server.",
      outcome.error ? String(outcome.error.message || outcome.error) : "Reload the page to see how the turn ended.");
  }
  return outcome.kind;
}

function eventsUrl(id) {
  return "/sessions/" + encodeURIComponent(id) + "/events";
}

// After the server went down mid-turn: waits until it is back (for a
// minute at most), then shows the chat as it stands.
async function reopenWhenBack() {
  const generation = state.generation;
  for (let attempt = 0; attempt < 30; attempt++) {
    await sleep(2000);
    if (generation !== state.generation) return;
    try {
      if ((await fetch("/healthz")).ok) {
        await openSession(state.session, { keepScroll: true });
        return;
      }
    } catch (_) { /* not back yet */ }
  }
}

function afterRun() {
  refreshApprovals();
  loadSessions();
}

async function ensureSession() {
  if (state.session !== null) return state.session;
  const response = await fetch("/sessions", { method: "POST" });
  if (response.status === 401) { signedOut(); return null; }
  if (!response.ok) { showError("Cannot start a chat", await errorOf(response)); return null; }
  state.session = (await response.json()).id;
  document.body.dataset.session = state.session;
  history.replaceState(null, "", "#" + state.session);
  loadSessions();
  return state.session;
}

async function send(text) {
  if (state.running) return;
  const generation = state.generation;
  setRunning(true);
  const id = await ensureSession();
  if (id === null || generation !== state.generation) { setRunning(false); return; }
  remember(id, text);
  state.echo = text;
  state.echoNode = userMessage(text);
  toEnd();
  const sent = state.echoNode;
  const outcome = await stream((signal) => fetch("/sessions/" + encodeURIComponent(id) + "/messages", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ text }),
    signal,
  }), "Not sent");
  if (outcome === "refused" && state.echoNode === sent) {
    sent.classList.add("failed");
    sent.title = "not sent";
  }
  state.echo = null;
  state.echoNode = null;
}

async function cancel() {
  if (!state.running || state.session === null) return;
  const stop = $("stop");
  stop.disabled = true;
  stop.textContent = "Stopping…";
  const response = await fetch("/sessions/" + encodeURIComponent(state.session) + "/cancel", { method: "POST" });
  if (!response.ok && response.status !== 409) showError("Cannot stop the turn", await errorOf(response));
}

// ---- Approvals ------------------------------------------------------------------------

async function decide(request, body, box) {
  if (state.running) return;
  box.classList.add("deciding");
  for (const control of box.querySelectorAll("button, input, textarea")) control.disabled = true;
  const outcome = await stream((signal) => fetch(
    "/sessions/" + encodeURIComponent(state.session) + "/approvals/" + encodeURIComponent(request.request_id), {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(body),
      signal,
    }), "Not decided");
  if (outcome !== "ended") refreshApprovals();
}

function approvalBox(request) {
  const box = el("div", "approval");
  box.dataset.request = request.request_id;
  const title = el("h2");
  title.append("Approve ");
  const tool = el("code");
  showVisibly(tool, request.tool);
  title.append(tool, "?");
  const args = el("pre", "args");
  showVisibly(args, JSON.stringify(request.args, null, 2));
  const preview = el("div", "preview");
  showVisibly(preview, request.preview);
  const meta = el("div", "meta", "Expires at " + new Date(request.expires).toLocaleTimeString());
  const actions = el("div", "actions");
  actions.append(button("Approve", "approve", () => decide(request, { decision: "approve" }, box)));
  // Arguments can be edited when the run paused for the call.
  const paused = Boolean(request.call_id);
  if (paused) actions.append(button("Edit", "edit", () => box.classList.toggle("editing")));
  const reason = el("input", "deny-message");
  reason.placeholder = "Why not (the model reads it)";
  reason.setAttribute("aria-label", "reason for denying");
  actions.append(reason);
  actions.append(button("Deny", "deny", () => {
    const message = reason.value.trim();
    decide(request, message ? { decision: "deny", message } : { decision: "deny" }, box);
  }));
  box.append(title, el("div", "label", "Arguments"), args, el("div", "label", "What it does"), preview, meta, actions);
  if (paused) {
    const editor = el("div", "editor");
    const area = el("textarea", "edit-args");
    area.setAttribute("aria-label", "edited arguments (JSON)");
    area.value = JSON.stringify(request.args, null, 2);
    const problem = el("div", "meta");
    editor.append(area, button("Approve edited", "approve-edited", () => {
      let edited;
      try { edited = JSON.parse(area.value); } catch (e) { problem.textContent = "Not JSON: " + e.message; return; }
      decide(request, { decision: "edit", args: edited }, box);
    }), problem);
    box.append(editor);
  }
  return box;
}

function showApprovals(pending) {
  follow(() => $("approvals").replaceChildren(...pending.map(approvalBox)));
  state.waiting = pending.length;
  if (pending.length) $("empty").hidden = true;
  updateComposer();
}

async function refreshApprovals() {
  if (state.session === null) { showApprovals([]); return; }
  const generation = state.generation;
  const response = await fetch("/sessions/" + encodeURIComponent(state.session) + "/approvals");
  if (generation !== state.generation || state.running) return;
  showApprovals(response.ok ? await response.json() : []);
}

// ---- Chats ------------------------------------------------------------------------------

function titles() {
  try { return JSON.parse(localStorage.getItem("markov.titles") || "{}"); } catch (_) { return {}; }
}

// A chat is called by its first message (kept in this browser).
function remember(id, text) {
  if (!id) return;
  const all = titles();
  if (all[id]) return;
  all[id] = clip(text.replace(/\s+/g, " ").trim(), 80);
  try { localStorage.setItem("markov.titles", JSON.stringify(all)); } catch (_) { /* full or off */ }
}

// A guard rewrote or blocked the message a chat was called by: the chat
// is called by what the conversation keeps (`to`), or by nothing.
function retitle(id, from, to) {
  const all = titles();
  if (!id || all[id] !== clip(from.replace(/\s+/g, " ").trim(), 80)) return;
  if (to === null) delete all[id];
  else all[id] = clip(to.replace(/\s+/g, " ").trim(), 80);
  try { localStorage.setItem("markov.titles", JSON.stringify(all)); } catch (_) { /* full or off */ }
  loadSessions();
}

function when(ms) {
  const d = new Date(ms);
  const today = new Date().toDateString() === d.toDateString();
  return today ? d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" })
    : d.toLocaleDateString([], { day: "numeric", month: "short" });
}

async function loadSessions() {
  const response = await fetch("/sessions");
  if (response.status === 401) { signedOut(); return; }
  if (!response.ok) return;
  const sessions = await response.json();
  const named = titles();
  const list = $("sessions");
  list.replaceChildren(...sessions.map((s) => {
    const item = el("li");
    const b = button("", "session" + (s.id === state.session ? " current" : ""), () => {
      document.body.classList.remove("menu-open");
      if (s.id !== state.session || !$("studio").hidden) openSession(s.id);
    });
    b.dataset.id = s.id;
    const title = el("span", "title" + (s.running ? " running" : ""));
    appendVisibly(title, named[s.id] || "Chat of " + new Date(s.created_at).toLocaleString([], { dateStyle: "medium", timeStyle: "short" }), PROSE);
    b.append(title, el("span", "meta", when(s.updated_at) + " · " + s.messages + " message" + (s.messages === 1 ? "" : "s")));
    item.append(b);
    return item;
  }));
}

function markCurrent() {
  for (const b of document.querySelectorAll("#sessions button")) {
    b.classList.toggle("current", b.dataset.id === state.session);
  }
}

// Leaves whatever chat was open: its stream stops rendering.
function reset(id) {
  state.generation++;
  if (state.controller) state.controller.abort();
  state.controller = null;
  state.session = id;
  state.echo = null;
  state.echoNode = null;
  state.cards = new Map();
  state.waiting = 0;
  endLive();
  setRunning(false);
  $("log").replaceChildren();
  $("approvals").replaceChildren();
  $("empty").hidden = false;
  if (id) document.body.dataset.session = id; else delete document.body.dataset.session;
  $("chatbar").hidden = !id;
  if (id) $("steps-link").href = "#steps/" + encodeURIComponent(id);
  markCurrent();
}

function newChat() {
  leaveStudio();
  reset(null);
  history.replaceState(null, "", location.pathname);
  document.body.classList.remove("menu-open");
  $("text").focus();
}

// Opens chat `id`: its history from the server, its waiting calls, and,
// when a turn runs, the turn's events from its start (the history the
// server sends then ends where the turn began, so nothing shows twice).
async function openSession(id, options = {}) {
  const scrolled = scroller().scrollTop;
  leaveStudio();
  reset(id);
  history.replaceState(null, "", "#" + id);
  const generation = state.generation;
  const response = await fetch("/sessions/" + encodeURIComponent(id));
  if (generation !== state.generation) return;
  if (response.status === 401) { signedOut(); return; }
  if (!response.ok) {
    showError("Cannot open this chat", await errorOf(response));
    state.session = null;
    history.replaceState(null, "", location.pathname);
    return;
  }
  const view = await response.json();
  if (generation !== state.generation) return;
  const live = view.live_run || null;
  const messages = live ? view.history.slice(0, live.history_len) : view.history;
  // Built apart and added at once: one layout for the whole history.
  const fragment = document.createDocumentFragment();
  state.target = fragment;
  try {
    if (view.team) {
      // A team's chat: its texts, each answer with the agent that wrote
      // it, and the handoffs where they happened.
      const handoffs = view.team.handoffs || [];
      const speakers = view.team.speakers || [];
      const upTo = (i) => { for (const h of handoffs) if (h.at === i) handoffNote(h); };
      messages.forEach((message, i) => {
        upTo(i);
        state.speaker = speakers[i] || null;
        showMessage(message);
      });
      state.speaker = null;
      // A running turn's handoffs come with its events.
      upTo(messages.length);
    } else {
      for (const message of messages) showMessage(message);
    }
  } finally {
    state.target = null;
    state.speaker = null;
  }
  if (fragment.childNodes.length) append(fragment);
  if (live && live.message) {
    // The message that started the turn, which its first step records:
    // shown now, and not again then.
    state.echo = live.message;
    state.echoNode = userMessage(live.message);
  }
  if (!live) showApprovals(view.pending_approvals || []);
  if (options.keepScroll) scroller().scrollTop = scrolled; else toEnd();
  markCurrent();
  if (live) {
    await stream((signal) => fetch(eventsUrl(id), { headers: { "last-event-id": live.last_event_id }, signal }),
      "Cannot follow the turn");
  }
}

// ---- The studio: a session's steps ------------------------------------------------------
//
// The steps the store recorded, a page at a time (more as the list's end
// scrolls into view), each a line that opens to what the step added (the
// answer, each tool call with its arguments and result), its usage and
// latency, and, on a click, the request exactly as the model received it.
// A running session's new steps are polled for while the list is shown.

const STEP_PAGE = 50;
const studio = { id: null, next: 0, generation: 0, poll: null, count: 0, loading: false, wire: false, exportable: false, team: null };

function leaveStudio() {
  studio.generation++;
  clearTimeout(studio.poll);
  showStudio(false);
}

function showStudio(shown) {
  $("chat").hidden = shown;
  $("studio").hidden = !shown;
}

function usageLine(usage) {
  if (!usage || typeof usage !== "object") return "";
  const tokens = (usage.input_tokens || 0) + " in / " + (usage.output_tokens || 0) + " out";
  const cost = typeof usage.cost === "number" && usage.cost > 0 ? " · $" + usage.cost.toFixed(4) : "";
  return tokens + cost;
}

function pre(text) {
  const node = el("pre");
  showLong(node, text, STRICT);
  return node;
}

// What the policy decided of a tool call, as its step's trace recorded it,
// with the call's duration: a line a person reads.
function decision(trace) {
  if (!trace || typeof trace !== "object") return "Not recorded for this step";
  const kind = (error) => error ? " (" + String(error).toLowerCase().replaceAll("_", " ") + ")" : "";
  let line;
  switch (trace.outcome) {
    case "ran": line = trace.ok ? "Allowed: the tool ran and succeeded" : "Allowed: the tool ran and failed" + kind(trace.error); break;
    case "refused": line = "Refused by the " + String(trace.stage || "policy").replaceAll("_", " ") + " stage" + kind(trace.error) + ": the tool did not run"; break;
    case "awaiting": line = "Waiting for a person's approval: the tool did not run yet"; break;
    case "ledger": line = "Answered from the ledger (it ran before): the tool did not run again"; break;
    case "answered": line = "Answered without running the tool"; break;
    default: line = "Decided: " + String(trace.outcome);
  }
  if (trace.approval && typeof trace.approval === "object") {
    line += " · after approval: " + String(trace.approval.decision) + (trace.approval.by ? " by " + String(trace.approval.by) : "");
  }
  if (typeof trace.ms === "number") line += " · " + trace.ms + " ms";
  return line;
}

// Where a step's request is read: its session and its place there (an
// agent's own session, in a team conversation's timeline).
function stepAddress(step) {
  const team = step.team;
  return team && typeof team.session === "string"
    ? { session: team.session, n: team.step }
    : { session: studio.id, n: step.index };
}

// The steps a sub-agent ran for one tool call, collapsed under the call:
// each a line that opens to what a step shows, nested sub-agents nested.
function subAgentRun(run, address) {
  const box = el("details", "sub-agent");
  box.dataset.call = run.call_id;
  const count = (run.steps || []).length;
  const head = el("summary");
  const name = el("code", "name");
  appendVisibly(name, String(run.agent));
  const calls = run.usage && typeof run.usage.requests === "number" ? run.usage.requests : 0;
  head.append("Sub-agent ", name, " · " + count + (count === 1 ? " step" : " steps") + " · " + usageLine(run.usage)
    + (calls ? " · " + calls + (calls === 1 ? " model call" : " model calls") : "") + " (counted in this step's usage)");
  box.append(head);
  (run.steps || []).forEach((step, i) => {
    const line = el("details", "sub-step");
    line.dataset.at = step.at;
    const summary = el("summary");
    let gist = "";
    for (const message of step.messages || []) {
      for (const i of itemsOf(message)) {
        if (i.type === "tool_use") gist += (gist ? " · " : "") + i.name + "(" + clip(brief(i.input), 40) + ")";
        else if (message.role === "assistant" && i.type === "text" && i.text && !gist) gist = i.text.split("\n")[0];
      }
    }
    for (const request of step.approvals || []) gist += (gist ? " · " : "") + "waits: " + request.tool + "(" + clip(brief(request.args), 40) + ")";
    const gistNode = el("span", "gist");
    appendVisibly(gistNode, clip(gist, 160), PROSE);
    const agent = el("span", "agent");
    appendVisibly(agent, String(step.agent));
    summary.append(agent, el("span", "reason " + step.yield_reason, step.yield_reason), gistNode,
      el("span", "meta", usageLine(step.usage) + " · " + step.step_ms + " ms"));
    line.append(summary);
    line.addEventListener("toggle", () => {
      if (!line.open || line.dataset.built) return;
      line.dataset.built = "1";
      const body = el("div", "body");
      stepBody(step, body, address, i === 0 ? "Input from the calling agent" : null);
      if (step.has_request) {
        const actions = el("div", "actions");
        const show = button("Show the request", "show-request", () => showSubRequest(address, step, actions, show));
        actions.append(show);
        body.append(actions);
      } else if (step.node) {
        body.append(el("p", "no-request", "The request is not shown: the sub-agent's history before this step is not recorded in the steps read, or a context policy chose what its model saw."));
      }
      line.append(body);
    });
    box.append(line);
  });
  return box;
}

// A sub-agent step's request, rebuilt from the sub-agent's recorded
// history, under the button that asked for it.
async function showSubRequest(address, step, actions, button) {
  button.disabled = true;
  const path = "/sessions/" + encodeURIComponent(address.session) + "/steps/" + address.n + "/sub_agents/" + step.at;
  const response = await fetch(path + "/request");
  if (!response.ok) { actions.after(el("div", "label", "Cannot read the request: " + await errorOf(response))); return; }
  const request = (await response.json()).request || {};
  const shown = el("div", "request");
  const messages = el("details");
  const count = (request.messages || []).length;
  messages.append(el("summary", null, count + (count === 1 ? " message" : " messages")), pre(JSON.stringify(request.messages, null, 2)));
  const tools = el("details");
  tools.append(el("summary", null, (request.tools || []).map((t) => t.name).join(", ") || "no tools"), pre(JSON.stringify(request.tools, null, 2)));
  const whole = el("details", "whole");
  whole.append(el("summary", null, "Whole request body"), pre(JSON.stringify(request, null, 2)));
  shown.append(el("div", "label", "System prompt"), pre(String(request.system || "")),
    el("div", "label", "Messages"), messages, el("div", "label", "Tools"), tools,
    el("div", "label", "Tool choice and settings"), pre(JSON.stringify({ tool_choice: request.tool_choice, settings: request.settings })), whole);
  if (step.wire === true) shown.append(wireBody(path + "/wire"));
  actions.after(shown);
}

// The provider's wire body of the request read at `path`, fetched when
// first opened.
function wireBody(path) {
  const wire = el("details", "wire");
  wire.append(el("summary", null, "Wire body, as sent to the provider (no headers, no keys)"));
  wire.addEventListener("toggle", async () => {
    if (!wire.open || wire.dataset.loaded) return;
    wire.dataset.loaded = "1";
    const response = await fetch(path);
    if (!response.ok) { wire.append(el("div", "label", "Cannot show the wire body: " + await errorOf(response))); return; }
    const sent = await response.json();
    wire.append(pre(JSON.stringify(sent.body, null, 2)));
  });
  return wire;
}

// What a step added, as the timeline shows it: text, and each tool call
// beside its result (and the sub-agent it ran, collapsed under it).
// `input` names the step's first user message when it is not the user's
// words: a sub-agent's input from its caller, or what a handoff gave.
function stepBody(step, box, address = stepAddress(step), input = null) {
  if (!input && step.team && step.team.handoff) input = "Given by the handoff (markov's note to " + step.team.agent + ")";
  const runs = new Map((step.sub_agents || []).map((run) => [run.call_id, run]));
  const calls = new Map();
  const traces = new Map((step.tool_calls || []).map((trace) => [trace.call_id, trace]));
  for (const message of step.messages || []) {
    for (const item of itemsOf(message)) {
      if (message.role === "user" && item.type === "text" && item.text) {
        const label = input || (fromInstance(message) ? "From an agent" : "User");
        input = null;
        box.append(el("div", "label", label), pre(item.text));
      } else if (message.role === "assistant" && item.type === "text" && item.text) {
        box.append(el("div", "label", "Answer"), pre(item.text));
      } else if (item.type === "tool_use") {
        const call = el("div", "call");
        call.dataset.call = item.id;
        const name = el("code", "name");
        appendVisibly(name, item.name);
        call.append(el("div", "label", "Tool call"), name, pre(JSON.stringify(item.input, null, 2)));
        call.append(el("div", "label", "Policy decision"), el("div", "decision", decision(traces.get(item.id))));
        calls.set(item.id, call);
        box.append(call);
        if (runs.has(item.id)) {
          call.after(subAgentRun(runs.get(item.id), address));
          runs.delete(item.id);
        }
      } else if (item.type === "tool_result") {
        const result = readResult(item.content, item.is_error === true);
        const call = calls.get(item.tool_use_id) || box.appendChild(el("div", "call"));
        call.classList.add(result.ok ? "ok" : "failed");
        const label = result.ok ? "Result" : "Refused or failed" + (result.kind ? " (" + result.kind.toLowerCase().replaceAll("_", " ") + ")" : "");
        call.append(el("div", "label", label), pre(result.text));
      }
    }
  }
  // A sub-agent resumed here for a call its caller made in an earlier step.
  for (const run of runs.values()) box.append(subAgentRun(run, address));
  for (const request of step.approvals || []) {
    const call = el("div", "call");
    call.append(el("div", "label", "Waiting for approval"), pre(String(request.tool) + " " + JSON.stringify(request.args)));
    box.append(call);
  }
  box.append(el("div", "label", "Usage and latency"),
    pre(usageLine(step.usage) + "\nstep " + step.step_ms + " ms · model " + step.model_ms + " ms · tools " + step.tools_ms + " ms"
      + (step.node ? "\nnode " + step.node : "") + "\ntool choice " + JSON.stringify(step.tool_choice) + " of " + step.tools + " tools"));
}

// The request of step `n`, as the model received it: its parts, and the
// whole body one more click away.
async function showRequest(n, box, button) {
  button.disabled = true;
  const response = await fetch("/sessions/" + encodeURIComponent(studio.id) + "/steps/" + n + "/request");
  if (!response.ok) { box.append(el("div", "label", "Cannot read the request: " + await errorOf(response))); return; }
  const body = await response.json();
  const request = body.request || {};
  const shown = el("div", "request");
  shown.append(el("div", "label", "System prompt"), pre(String(request.system || "")));
  const messages = el("details");
  const count = (request.messages || []).length;
  messages.append(el("summary", null, count + (count === 1 ? " message" : " messages")), pre(JSON.stringify(request.messages, null, 2)));
  const tools = el("details");
  tools.append(el("summary", null, (request.tools || []).map((t) => t.name).join(", ") || "no tools"), pre(JSON.stringify(request.tools, null, 2)));
  shown.append(el("div", "label", "Messages"), messages, el("div", "label", "Tools"), tools,
    el("div", "label", "Tool choice and settings"), pre(JSON.stringify({ tool_choice: request.tool_choice, settings: request.settings })));
  const whole = el("details", "whole");
  whole.append(el("summary", null, "Whole request body"), pre(JSON.stringify(request, null, 2)));
  shown.append(whole);
  if (studio.wire) shown.append(wireBody("/sessions/" + encodeURIComponent(studio.id) + "/steps/" + n + "/wire"));
  // Under the button that asked for it.
  button.parentElement.after(shown);
}

async function forkAt(n, edit, button) {
  button.disabled = true;
  const text = edit.value.trim();
  const response = await fetch("/sessions/" + encodeURIComponent(studio.id) + "/steps/" + n + "/fork", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(text ? { edit_user: text } : {}),
  });
  if (!response.ok) {
    $("studio-error").textContent = "Cannot fork at step " + n + ": " + await errorOf(response);
    button.disabled = false;
    return;
  }
  const fork = await response.json();
  // Named for where it came from, so that the list tells it from its source.
  remember(fork.id, "Fork of " + (titles()[studio.id] || "a chat") + " at step " + n);
  await loadSessions();
  location.hash = "#" + fork.id;
}

function stepLine(step) {
  const item = el("li");
  item.dataset.step = step.index;
  const details = el("details");
  const summary = el("summary");
  const reason = el("span", "reason " + step.yield_reason, step.yield_reason);
  let gist = "";
  let refused = false;
  for (const message of step.messages || []) {
    for (const i of itemsOf(message)) {
      if (i.type === "tool_use") gist += (gist ? " · " : "") + i.name + "(" + clip(brief(i.input), 40) + ")";
      else if (message.role === "assistant" && i.type === "text" && i.text && !gist) gist = i.text.split("\n")[0];
      else if (i.type === "tool_result" && !readResult(i.content, i.is_error === true).ok) refused = true;
    }
  }
  for (const request of step.approvals || []) {
    gist += (gist ? " · " : "") + "waits: " + request.tool + "(" + clip(brief(request.args), 40) + ")";
  }
  const gistNode = el("span", "gist");
  appendVisibly(gistNode, clip(gist, 200), PROSE);
  summary.append(el("span", "n", "#" + step.index));
  if (step.team) {
    const agent = el("span", "agent");
    appendVisibly(agent, String(step.team.agent));
    summary.append(agent);
  }
  summary.append(reason, gistNode);
  const subs = countSubSteps(step.sub_agents);
  if (subs > 0) summary.append(el("span", "subs", subs + (subs === 1 ? " sub-agent step" : " sub-agent steps")));
  if (refused) summary.append(el("span", "refused", "refused"));
  summary.append(el("span", "meta", usageLine(step.usage) + " · " + step.step_ms + " ms"));
  details.append(summary);
  // Built when first opened: a long session's list stays light.
  details.addEventListener("toggle", () => {
    if (!details.open || details.dataset.built) return;
    details.dataset.built = "1";
    const body = el("div", "body");
    stepBody(step, body);
    // A step that called the model forks; its request shows where the
    // trace can rebuild it.
    if (studio.team && step.team) {
      // A team's step: its request is its agent's session's; no fork.
      const actions = el("div", "actions");
      if (step.has_request) {
        const address = stepAddress(step);
        const requestButton = button("Show the request", "show-request", () => showAgentRequest(address, step.wire === true, actions, requestButton));
        actions.append(requestButton);
      }
      body.append(actions, el("p", "no-fork", String(studio.team.no_fork || "")));
    } else if (step.has_request || step.node) {
      const actions = el("div", "actions");
      if (step.has_request) {
        const requestButton = button("Show the request", "show-request", () => showRequest(step.index, body, requestButton));
        actions.append(requestButton);
      }
      const edit = el("input");
      edit.placeholder = "Optional: the user's message, edited";
      edit.setAttribute("aria-label", "Edited user message for the fork");
      const forkButton = button("Fork here", "fork", () => forkAt(step.index, edit, forkButton));
      actions.append(edit, forkButton);
      body.append(actions);
      if (!step.has_request) {
        body.append(el("p", "no-request", "The request is not shown: the step was recorded under a context policy before markov kept what its view showed."));
      }
    }
    if (studio.exportable) {
      const save = el("a", "save-case", "Save this step's turn as a test");
      save.href = "/sessions/" + encodeURIComponent(studio.id) + "/case?from=" + step.index + "&to=" + (step.index + 1);
      save.setAttribute("download", "");
      body.append(save);
    }
    details.append(body);
  });
  if (step.team && step.team.handoff) {
    const handoff = step.team.handoff;
    const mark = el("div", "handoff-mark");
    appendVisibly(mark, handoff.from + " handed the conversation to " + handoff.to + (handoff.reason ? ": " + handoff.reason : ""), PROSE);
    item.append(mark);
  }
  item.append(details);
  return item;
}

// How many sub-agent steps a step's calls ran, nested ones included.
function countSubSteps(runs) {
  let count = 0;
  for (const run of runs || []) {
    for (const step of run.steps || []) count += 1 + countSubSteps(step.sub_agents);
  }
  return count;
}

// A team step's request, read from its agent's own session.
async function showAgentRequest(address, wire, actions, button) {
  button.disabled = true;
  const path = "/sessions/" + encodeURIComponent(address.session) + "/steps/" + address.n;
  const response = await fetch(path + "/request");
  if (!response.ok) { actions.after(el("div", "label", "Cannot read the request: " + await errorOf(response))); return; }
  const request = (await response.json()).request || {};
  const shown = el("div", "request");
  const count = (request.messages || []).length;
  const messages = el("details");
  messages.append(el("summary", null, count + (count === 1 ? " message" : " messages")), pre(JSON.stringify(request.messages, null, 2)));
  const whole = el("details", "whole");
  whole.append(el("summary", null, "Whole request body"), pre(JSON.stringify(request, null, 2)));
  shown.append(el("div", "label", "System prompt"), pre(String(request.system || "")), el("div", "label", "Messages"), messages, whole);
  if (wire) shown.append(wireBody(path + "/wire"));
  actions.after(shown);
}

async function moreSteps() {
  const generation = studio.generation;
  // `loading` names the list being loaded: a page still on its way for a
  // list since replaced does not hold up the new one.
  if (studio.loading === generation || studio.next === null) return;
  studio.loading = generation;
  try {
    const response = await fetch("/sessions/" + encodeURIComponent(studio.id) + "/steps?from=" + studio.next + "&limit=" + STEP_PAGE);
    if (generation !== studio.generation) return;
    if (response.status === 401) { signedOut(); return; }
    if (!response.ok) { $("studio-error").textContent = "Cannot read the steps: " + await errorOf(response); return; }
    const page = await response.json();
    if (generation !== studio.generation) return;
    $("timeline").append(...page.steps.map(stepLine));
    $("replay-controls").hidden = page.replayable !== true;
    studio.team = page.team && typeof page.team === "object" ? page.team : null;
    studio.wire = page.wire === true;
    studio.exportable = page.exportable === true;
    $("save-case").hidden = !studio.exportable;
    $("save-case").href = "/sessions/" + encodeURIComponent(studio.id) + "/case";
    studio.count += page.steps.length;
    const last = page.steps.length ? page.steps[page.steps.length - 1].index + 1 : studio.next;
    studio.next = typeof page.next === "number" ? page.next : null;
    studio.after = last;
    $("more").hidden = studio.next === null;
    $("studio-count").textContent = studio.count + " step" + (studio.count === 1 ? "" : "s") + (studio.next === null ? "" : " shown so far");
  } finally {
    if (studio.loading === generation) studio.loading = false;
  }
  // A page shorter than the view leaves its end in view: the next one.
  if (generation === studio.generation && studio.next !== null && endInView()) setTimeout(moreSteps, 0);
}

// While the list is shown and all of it loaded, asks for steps recorded
// since: a running session's steps appear as they are stored.
async function pollSteps(generation) {
  if (generation !== studio.generation || $("studio").hidden) return;
  if (studio.next === null && studio.loading !== generation) {
    studio.next = studio.after || 0;
    await moreSteps();
  } else if (endInView()) {
    // The observer speaks only when the end comes into view: a page that
    // failed while the end stayed in view is asked for again here.
    await moreSteps();
  }
  studio.poll = setTimeout(() => pollSteps(generation), 2000);
}

async function openSteps(id) {
  reset(id);
  studio.generation++;
  clearTimeout(studio.poll);
  studio.id = id;
  studio.next = 0;
  studio.after = 0;
  studio.count = 0;
  $("timeline").replaceChildren();
  $("studio-error").textContent = "";
  $("studio-count").textContent = "";
  $("back-link").href = "#" + id;
  $("replay-diff").hidden = true;
  $("replay-diff").replaceChildren();
  $("replay-controls").hidden = true;
  $("save-case").hidden = true;
  studio.team = null;
  showStudio(true);
  await moreSteps();
  studio.poll = setTimeout(() => pollSteps(studio.generation), 2000);
}

// What a side of a replayed step answered: its text and tool calls.
function answerText(side) {
  if (!side) return "—";
  const calls = (side.tool_calls || []).map(([name, args]) => name + "(" + clip(brief(args), 60) + ")");
  return [side.text || "", ...calls].filter(Boolean).join(" · ") || "(nothing)";
}

// Replays the session against the agent as the server runs it now and
// shows where the runs part, step by step.
async function replay() {
  const shown = $("replay-diff");
  $("replay").disabled = true;
  shown.hidden = false;
  shown.replaceChildren(el("p", "note", "Replaying…"));
  const generation = studio.generation;
  try {
    const response = await fetch("/sessions/" + encodeURIComponent(studio.id) + "/replay", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ mode: $("replay-live").checked ? "live" : "recorded_where_unchanged" }),
    });
    if (generation !== studio.generation) return;
    if (!response.ok) { shown.replaceChildren(el("p", "note", "Cannot replay: " + await errorOf(response))); return; }
    const report = await response.json();
    const parted = typeof report.parted_at === "number";
    const heading = el("h3", null, parted ? "The runs part at step " + report.parted_at : "The replay runs as recorded");
    const calls = report.tool_calls || [];
    const count = (source) => calls.filter((call) => call.answered_from === source).length;
    const notes = [el("p", "note", "Mode: " + String(report.mode).replaceAll("_", " ") + ". "
      + (calls.length === 0 ? "No tool was called."
        : "Tool calls: " + count("recorded") + " answered from the recording (the tool did not run), "
          + count("live") + " ran live, " + count("refused") + " refused (side effects not run again)."))];
    if (calls.length > 0) {
      const list = el("ul", "replay-calls");
      for (const call of calls) list.append(el("li", null, "#" + call.step + " " + call.tool + "(" + clip(brief(call.args), 60) + ") — " + call.answered_from));
      notes.push(list);
    }
    if (report.error) notes.push(el("p", "note", "The replay stopped early: " + report.error));
    const table = el("table");
    const head = el("tr");
    for (const title of ["Step", "Request", "Answer from", "Recorded answer", "Replayed answer", "Usage (recorded → replayed)"]) head.append(el("th", null, title));
    table.append(head);
    for (const step of report.steps || []) {
      const row = el("tr", (step.request_changed || step.answer_changed ? "changed" : "") + (parted && step.index === report.parted_at ? " parted" : ""));
      row.dataset.step = step.index;
      const cells = [
        "#" + step.index,
        step.request_changed ? "changed" : "same",
        step.answered_from || "—",
        answerText(step.recorded),
        answerText(step.replayed),
        usageLine(step.recorded && step.recorded.usage) + " → " + usageLine(step.replayed && step.replayed.usage),
      ];
      for (const text of cells) {
        const cell = el("td");
        appendVisibly(cell, text, PROSE);
        row.append(cell);
      }
      table.append(row);
    }
    shown.replaceChildren(heading, ...notes, table);
  } finally {
    $("replay").disabled = false;
  }
}

$("replay").onclick = replay;
$("more").onclick = moreSteps;
// Whether the list's end is in view now (an observer's entry can be older
// than the page that moved it out of view).
function endInView() {
  if ($("studio").hidden) return false;
  const view = $("studio").getBoundingClientRect();
  const end = $("studio-more").getBoundingClientRect();
  return end.top < view.bottom && end.bottom > view.top;
}
new IntersectionObserver(() => {
  if (endInView()) moreSteps();
}, { root: $("studio") }).observe($("studio-more"));

// Opens what the address names: a chat (`#id`) or its steps (`#steps/id`).
function route() {
  const hash = decodeURIComponent(location.hash.slice(1));
  if (hash.startsWith("steps/")) {
    const id = hash.slice("steps/".length);
    if (id) return openSteps(id);
  }
  const fromStudio = !$("studio").hidden;
  if (hash && (hash !== state.session || fromStudio)) return openSession(hash);
  leaveStudio();
  if (!hash) $("text").focus();
}

// ---- Signing in -------------------------------------------------------------------------

function signedOut() {
  reset(null);
  // The next person to sign in must not see this one's chats, not even
  // until their own list arrives.
  $("sessions").replaceChildren();
  $("signin").hidden = false;
  $("app").hidden = true;
  $("who").hidden = true;
  $("model").hidden = true;
  $("menu").hidden = true;
  delete document.body.dataset.principal;
  $("key").focus();
}

async function showModel() {
  const response = await fetch("/agents");
  if (!response.ok) return;
  const agents = await response.json();
  const agent = agents.find((a) => a.default) || agents[0];
  if (!agent) return;
  state.agent = agent.name;
  const line = $("model");
  line.replaceChildren();
  const name = el("span", "agent");
  appendVisibly(name, agent.name);
  line.append(name);
  if (agent.model) {
    line.append(" · ");
    appendVisibly(line, agent.model);
  }
  line.title = agent.model ? agent.name + " · " + agent.model : agent.name;
  line.hidden = false;
  // In full where there is room for it (the header cuts it on a phone).
  const about = $("about");
  about.replaceChildren("Agent ");
  const named = el("span", "agent");
  appendVisibly(named, agent.name);
  about.append(named);
  if (agent.model) {
    about.append(" on ");
    appendVisibly(about, agent.model);
  }
  about.hidden = false;
}

// The page asks who it is; without a sign-in it shows the key form, and a
// key exchanged for the service's cookie shows the chats.
async function whoAmI() {
  const response = await fetch("/me");
  if (!response.ok) { signedOut(); return; }
  const me = await response.json();
  document.body.dataset.principal = me.principal;
  $("principal").textContent = me.principal;
  $("signin").hidden = true;
  $("app").hidden = false;
  $("who").hidden = false;
  $("menu").hidden = false;
  updateComposer();
  await Promise.all([showModel(), loadSessions()]);
  await route();
}

$("signin").onsubmit = async (event) => {
  event.preventDefault();
  const input = $("key");
  const response = await fetch("/auth/session", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ key: input.value.trim() }),
  });
  input.value = "";
  const error = $("signin-error");
  if (response.ok) {
    error.textContent = "";
    await whoAmI();
  } else {
    error.textContent = response.status === 401 ? "That key is not valid." : await errorOf(response);
  }
};

$("signout").onclick = async () => {
  await fetch("/auth/session", { method: "DELETE" });
  history.replaceState(null, "", location.pathname);
  signedOut();
};

// ---- The composer -----------------------------------------------------------------------

function grow() {
  const text = $("text");
  text.style.height = "";
  if (text.value) text.style.height = Math.min(text.scrollHeight + 2, 192) + "px";
}

$("form").onsubmit = (event) => {
  event.preventDefault();
  if ($("send").disabled) return;
  const input = $("text");
  const text = input.value.trim();
  if (!text) return;
  input.value = "";
  grow();
  send(text);
};

$("text").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("form").requestSubmit();
  }
});
$("text").addEventListener("input", grow);
$("stop").onclick = cancel;
$("new").onclick = newChat;
$("menu").onclick = () => {
  const open = document.body.classList.toggle("menu-open");
  $("menu").setAttribute("aria-expanded", String(open));
};
$("conversation").addEventListener("click", () => document.body.classList.remove("menu-open"));
window.addEventListener("hashchange", () => {
  if (!$("app").hidden) route();
});

whoAmI();
