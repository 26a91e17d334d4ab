// lmq chat page: talks to this gateway's OpenAI-compatible API, streams with fetch + SSE.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), modelStatus: $("model-status"), system: $("system"), temperature: $("temperature"),
  maxTokens: $("max-tokens"), apiKey: $("api-key"), newChat: $("new-chat"), messages: $("messages"),
  empty: $("empty"), composer: $("composer"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
};
const KEY_STORE = "lmq.apiKey";
const MODEL_STORE = "lmq.model";

const history = []; // the conversation sent with every turn: {role, content}
let controller = null; // the AbortController of the answer streaming now
let modelsTimer = null;
let conversation = 0; // bumped by "New chat", so an answer that ends later leaves the new one alone

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = ui.apiKey.value.trim();
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || `${response.status} ${response.statusText}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

async function loadModels() {
  clearTimeout(modelsTimer);
  let problem = "";
  let retry = true;
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (response.status === 401) {
      problem = ui.apiKey.value.trim() ? "The API key was refused." : "This gateway needs an API key.";
      retry = false;
    } else if (!response.ok) {
      problem = await errorText(response);
    } else {
      const names = (await response.json()).data.map((model) => model.id);
      const wanted = ui.model.value || localStorage.getItem(MODEL_STORE);
      ui.model.replaceChildren(...names.map((name) => new Option(name, name, false, name === wanted)));
      if (!names.length) problem = "No worker serves a model yet.";
    }
  } catch (error) {
    problem = `The gateway does not answer (${error.message}).`;
  }
  ui.modelStatus.textContent = problem;
  if (problem && retry) modelsTimer = setTimeout(loadModels, 3000);
  updateButtons();
}

function updateButtons() {
  const busy = controller !== null;
  ui.send.disabled = busy || !ui.model.value;
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
}

function nearBottom() {
  const box = ui.messages;
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}

function addMessage(role, text, label) {
  ui.empty.hidden = true;
  const item = document.createElement("article");
  item.className = `message ${role}`;
  const who = document.createElement("header");
  who.textContent = label;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  item.append(who, content);
  ui.messages.append(item);
  item.scrollIntoView({ block: "end" });
  return item;
}

// Yield the `data:` of each server-sent event in a fetch body, as the events arrive.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r/g, "");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((line) => line.startsWith("data:")).map((line) => line.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

function showStats(stats, element, note) {
  const parts = [];
  if (stats.first !== null) {
    parts.push(`TTFT ${Math.round(stats.first - stats.start)} ms`);
    const tokens = stats.tokens ?? stats.chunks;
    const seconds = (stats.last - stats.first) / 1000;
    if (tokens > 1 && seconds > 0) parts.push(`${((tokens - 1) / seconds).toFixed(1)} tokens/s`);
    parts.push(`${tokens} token${tokens === 1 ? "" : "s"}`);
  }
  if (note) parts.push(note);
  element.textContent = parts.join(" · ");
}

const numberIn = (input) => (input.value.trim() === "" ? undefined : Number(input.value)); // undefined: left out of the JSON

const NOTES = { stopped: "stopped", length: "max tokens reached", incomplete: "the stream ended early" };

async function ask(text) {
  const model = ui.model.value;
  const mine = conversation;
  localStorage.setItem(MODEL_STORE, model);
  const turn = { role: "user", content: text };
  history.push(turn);
  const question = addMessage("user", text, "You");
  const answer = addMessage("assistant", "", model);
  const statsLine = document.createElement("footer");
  answer.append(statsLine);
  answer.dataset.state = "waiting";
  const content = answer.querySelector(".content");
  const stats = { start: performance.now(), first: null, last: null, chunks: 0, tokens: null };
  controller = new AbortController();
  updateButtons();
  let reply = "";
  let state = "incomplete";
  try {
    const system = ui.system.value.trim();
    const body = {
      model,
      messages: system ? [{ role: "system", content: system }, ...history] : history,
      stream: true,
      stream_options: { include_usage: true },
      temperature: numberIn(ui.temperature), // left empty: the gateway's default
      max_tokens: numberIn(ui.maxTokens) && Math.max(1, Math.round(numberIn(ui.maxTokens))),
    };
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    answer.dataset.state = "streaming";
    for await (const data of sseData(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
      const choice = chunk.choices?.[0];
      if (choice?.delta?.content) {
        const follow = nearBottom();
        stats.first ??= performance.now();
        stats.last = performance.now();
        stats.chunks += 1;
        reply += choice.delta.content;
        content.textContent = reply;
        showStats(stats, statsLine);
        if (follow) answer.scrollIntoView({ block: "end" });
      }
      if (choice?.finish_reason) state = choice.finish_reason;
      if (chunk.usage) stats.tokens = chunk.usage.completion_tokens;
    }
  } catch (error) {
    if (error.name === "AbortError") {
      state = "stopped";
    } else {
      state = "error";
      const problem = document.createElement("p");
      problem.className = "error";
      problem.textContent = error.message;
      answer.insertBefore(problem, statsLine);
    }
  } finally {
    controller = null;
    updateButtons();
  }
  if (mine !== conversation) return;
  answer.dataset.state = state;
  showStats(stats, statsLine, NOTES[state]);
  if (reply) {
    history.push({ role: "assistant", content: reply }); // a stopped answer stays, as far as it got
  } else {
    history.splice(history.indexOf(turn), 1); // nothing came back: leave the question out of the conversation
    question.classList.add("unanswered");
    if (state !== "error") content.textContent = "(no answer)";
  }
  updateButtons();
  ui.prompt.focus();
}

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.prompt.value.trim();
  if (!text || controller || !ui.model.value) return;
  ui.prompt.value = "";
  ask(text);
});

ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.composer.requestSubmit();
  }
});

ui.stop.addEventListener("click", () => controller?.abort()); // closing the connection cancels the request

ui.newChat.addEventListener("click", () => {
  controller?.abort();
  conversation += 1;
  history.length = 0;
  ui.messages.querySelectorAll(".message").forEach((item) => item.remove());
  ui.empty.hidden = false;
  ui.prompt.focus();
});

ui.apiKey.value = localStorage.getItem(KEY_STORE) || "";
ui.apiKey.addEventListener("change", () => {
  const key = ui.apiKey.value.trim();
  if (key) localStorage.setItem(KEY_STORE, key);
  else localStorage.removeItem(KEY_STORE);
  loadModels();
});
ui.model.addEventListener("change", () => {
  localStorage.setItem(MODEL_STORE, ui.model.value);
  updateButtons();
});

loadModels();
ui.prompt.focus();
