// A minimal streaming chat over the OpenAI chat completions API (stream=true, SSE).
"use strict";

const conversation = [];  // {role, content} of the conversation so far
let controller = null;

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  document.getElementById("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function setBusy(busy) {
  document.getElementById("send").disabled = busy;
  document.getElementById("stop").disabled = !busy;
}

function requestBody() {
  const messages = [];
  const system = document.getElementById("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const body = { model: "default", messages, stream: true };
  const maxTokens = parseInt(document.getElementById("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  const temperature = parseFloat(document.getElementById("temperature").value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  return body;
}

// Each SSE event's data: the chunks' delta.content, until [DONE] or an error event.
async function readStream(response, onText) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const choice = chunk.choices && chunk.choices[0];
        if (choice && choice.delta && choice.delta.content) onText(choice.delta.content);
      }
    }
  }
}

async function send(text) {
  document.getElementById("error").textContent = "";
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  bubble.classList.add("streaming");
  setBusy(true);
  controller = new AbortController();
  let answer = "";
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error((error.error && error.error.message) || "HTTP " + response.status);
    }
    await readStream(response, (piece) => {
      answer += piece;
      bubble.textContent = answer;
      bubble.scrollIntoView({ block: "end" });
    });
  } catch (error) {
    if (error.name !== "AbortError") document.getElementById("error").textContent = String(error.message || error);
  } finally {
    bubble.classList.remove("streaming");
    bubble.dataset.done = "true";
    conversation.push({ role: "assistant", content: answer });
    controller = null;
    setBusy(false);
  }
}

async function showModel() {
  try {
    const response = await apiFetch("/v1/models");
    if (response.ok) document.getElementById("model").textContent = (await response.json()).data[0].id;
  } catch (error) { /* the title is cosmetic */ }
}

document.getElementById("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = document.getElementById("prompt");
  const text = prompt.value.trim();
  if (!text || controller) return;
  prompt.value = "";
  send(text);
});
document.getElementById("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    document.getElementById("composer").requestSubmit();
  }
});
document.getElementById("stop").addEventListener("click", () => controller && controller.abort());
document.getElementById("clear").addEventListener("click", (event) => {
  event.preventDefault();
  conversation.length = 0;
  document.getElementById("messages").replaceChildren();
});
document.getElementById("forget-key").addEventListener("click", (event) => {
  event.preventDefault();
  forgetKey();
});
showModel();
