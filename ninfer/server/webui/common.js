// Shared by the dashboard and the chat page: the API key (asked once, kept in this tab's
// sessionStorage) and fetch with it. No framework, no build step, nothing from other origins.
"use strict";

const KEY_STORAGE = "ninfer.apiKey";

function storedKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = storedKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

// Show the key form and resolve once the user saved a key.
let keyPromptOpen = null;
function askForKey(message) {
  if (keyPromptOpen) return keyPromptOpen;
  const box = document.getElementById("key-prompt");
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  document.getElementById("key-message").textContent = message || "This server needs an API key.";
  box.hidden = false;
  input.value = "";
  input.focus();
  keyPromptOpen = new Promise((resolve) => {
    form.onsubmit = (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY_STORAGE, key);
      box.hidden = true;
      keyPromptOpen = null;
      resolve(key);
    };
  });
  return keyPromptOpen;
}

// fetch with the key; a 401 asks for a key (again) and retries.
async function apiFetch(path, options) {
  for (;;) {
    const opts = Object.assign({}, options || {});
    opts.headers = authHeaders(opts.headers);
    const response = await fetch(path, opts);
    if (response.status !== 401) return response;
    const hadKey = Boolean(storedKey());
    sessionStorage.removeItem(KEY_STORAGE);
    await askForKey(hadKey ? "That key was refused; enter another." : "This server needs an API key.");
  }
}

function forgetKey() {
  sessionStorage.removeItem(KEY_STORAGE);
}

function formatBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(n < 10 ? 2 : 1) : String(n)) + " " + units[i];
}

function formatNumber(n, digits) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  return Number(n).toLocaleString("en-US", { maximumFractionDigits: digits === undefined ? 1 : digits });
}
