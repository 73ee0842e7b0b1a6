// The kvindex operator page: polls the public JSON API and draws what it answers.
// No framework and no build step: the server ships this file as it is here.
"use strict";

const TIERS = ["GPU", "CPU", "STORAGE"];
// Every poll reads each engine once; a large fleet is polled less often so the page
// never costs the server more than about 50 engine reads a second.
const POLL_MS = 2000;
const POLL_MS_PER_ENGINE = 20;
// "Recent" rates are measured over the polls of the last ten seconds.
const RATE_WINDOW_MS = 10000;
// A rank that streams normally is a batch or two behind at any instant; past either
// bound it is falling behind its engine.
const LAGGING = { batches: 10, seconds: 1 };

const $ = (selector) => document.querySelector(selector);
const fmt = (n) => (n ?? 0).toLocaleString("en-US");
const history = new Map(); // "engine/rank" -> [{t, seq, gpu}], oldest first
let selected = decodeURIComponent(location.hash.replace(/^#engine=/, "")) || null;
let lastStates = [];

// URLs are relative to the page (/ui/), so a path prefix in front of kvindex is kept.
const api = (path) => new URL(`../${path}`, location.href);

async function getJSON(path, init) {
  const answer = await fetch(api(path), init);
  const text = await answer.text();
  let body;
  try {
    body = JSON.parse(text);
  } catch {
    body = { error: text };
  }
  if (!answer.ok) {
    const error = new Error(`${answer.status}: ${body.error ?? text}`);
    error.status = answer.status;
    throw error;
  }
  return body;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("data-")) node.dataset[key.slice(5)] = value;
    else node.setAttribute(key, value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

const num = (value, attrs = {}) => el("td", { class: "num", ...attrs }, fmt(value));
const seconds = (s) => (s < 10 ? `${s.toFixed(1)} s` : `${Math.round(s)} s`);

function bar(tier, value, max) {
  const fill = el("span", { class: `bar ${tier}` });
  fill.style.width = `${max > 0 ? Math.min(100, (100 * value) / max) : 0}%`; // CSSOM: the CSP allows it
  return el("span", { class: "track" }, fill);
}

// Degraded by the server's one rule, with its reasons; lagging is judged here.
function rankState(rank) {
  if (rank.degraded) return { kind: "degraded", reason: rank.degraded_reasons.join("; ") };
  if (rank.lag_batches >= LAGGING.batches || rank.lag_seconds >= LAGGING.seconds) {
    const behind = `${fmt(rank.lag_batches)} batches, ${seconds(rank.lag_seconds)} behind`;
    return { kind: "lagging", reason: behind };
  }
  return { kind: "ok", reason: "" };
}

function stateCell(state) {
  const text = state.reason ? `${state.kind}: ${state.reason}` : state.kind;
  return el("td", { class: `reason state-${state.kind}`, "data-state": state.kind }, text);
}

// Batches applied and GPU blocks gained per second over the recent polls of one rank.
function recordRates(engine, rank, now) {
  const key = `${engine}/${rank.dp_rank}`;
  const seq = rank.applied_seq ?? -1;
  let samples = history.get(key) ?? [];
  // A seq lower than before is a restart (seq from 0): the window starts again.
  if (samples.length && seq < samples[samples.length - 1].seq) samples = [];
  samples.push({ t: now, seq, gpu: rank.blocks?.GPU ?? 0 });
  while (samples.length > 2 && now - samples[1].t >= RATE_WINDOW_MS) samples.shift();
  history.set(key, samples);
  const first = samples[0];
  const last = samples[samples.length - 1];
  const dt = (last.t - first.t) / 1000;
  if (dt <= 0) return { batches: null, gpu: null };
  return { batches: (last.seq - first.seq) / dt, gpu: (last.gpu - first.gpu) / dt };
}

const rate = (r) => el("td", { class: "num" }, r === null ? "—" : r.toFixed(1));

function renderSummary(stats, states) {
  const lagging = states.flatMap((s) => s.ranks).filter((r) => r.state.kind === "lagging").length;
  const totals = TIERS.map((t) => `${t} ${fmt(stats.blocks[t])}`);
  $("#summary").textContent =
    `${fmt(stats.engines)} engines · ${fmt(stats.registered_ranks)} ranks · ` +
    `${fmt(stats.connected_ranks)} connected · ${fmt(stats.degraded_ranks)} degraded · ` +
    `${lagging} lagging · blocks ${totals.join(" ")}` +
    (stats.compiled_core === false ? ` · compiled core not loaded: ${stats.compiled_core_error}` : "");
  const attention = stats.degraded_ranks + lagging;
  $("#attention").textContent = attention ? `(${attention} ranks need attention)` : "";
}

function renderFleet(states) {
  const ranks = states.flatMap((s) => s.ranks);
  const max = Object.fromEntries(TIERS.map((t) => [t, Math.max(0, ...ranks.map((r) => r.blocks?.[t] ?? 0))]));
  const rows = [];
  for (const engine of states) {
    engine.ranks.forEach((rank, i) => {
      const link = el("a", { class: "engine", href: `#engine=${encodeURIComponent(engine.name)}` }, engine.name);
      const lag = `${fmt(rank.lag_batches)} (${seconds(rank.lag_seconds ?? 0)})`;
      rows.push(
        el(
          "tr",
          { class: i === 0 ? "engine-start" : "", "data-engine": engine.name, "data-rank": rank.dp_rank },
          el("td", {}, i === 0 ? link : ""),
          el("td", {}, i === 0 ? engine.model || "—" : ""),
          num(rank.dp_rank),
          stateCell(rank.state),
          ...TIERS.map((t) =>
            el("td", { "data-tier": t }, el("span", { class: "cell-bar" }, bar(t, rank.blocks?.[t] ?? 0, max[t]), fmt(rank.blocks?.[t]))),
          ),
          num(rank.applied_seq ?? "—"),
          el("td", { class: "num" }, lag),
          rate(rank.rates.batches),
        ),
      );
    });
  }
  $("#fleet-table tbody").replaceChildren(...rows);
  $("#fleet-empty").hidden = states.length > 0;
}

function renderEngine(states) {
  const select = $("#engine-select");
  const names = states.map((s) => s.name);
  if (!names.includes(selected)) selected = names[0] ?? null;
  if ([...select.options].map((o) => o.value).join() !== names.join()) {
    select.replaceChildren(...names.map((n) => new Option(n, n)));
  }
  select.value = selected ?? "";
  const engine = states.find((s) => s.name === selected);
  if (!engine) {
    $("#engine-spec").replaceChildren();
    $("#engine-ranks tbody").replaceChildren();
    return;
  }
  const fields = ["model", "url", "endpoint", "replay_endpoint", "dp_ranks", "block_size", "learned_block_size", "hash_algo", "blocks_per_chunk", "topic", "bind"];
  $("#engine-spec").replaceChildren(
    ...fields.flatMap((f) => [el("dt", {}, f), el("dd", { "data-field": f }, String(engine[f] ?? "—"))]),
  );
  const rows = engine.ranks.map((rank) => {
    const rejected = Object.entries(rank.rejected ?? {});
    const rejectedCell = el("td", { class: "num", title: rejected.map(([k, v]) => `${k}: ${v}`).join("\n") });
    rejectedCell.textContent = fmt(rejected.reduce((n, [, v]) => n + v, 0));
    const missing = rank.missing ?? [];
    const seen = rank.last_event_ts ? new Date(rank.last_event_ts * 1000).toISOString().slice(0, 19).replace("T", " ") : "—";
    return el(
      "tr",
      { "data-rank": rank.dp_rank },
      num(rank.dp_rank),
      stateCell(rank.state),
      el("td", { class: "num" }, `${rank.applied_seq ?? "—"} / ${rank.last_seq ?? "—"}`),
      el("td", { class: "num", "data-field": "gaps" }, `${fmt(rank.gaps)} (${fmt(rank.gaps_filled)} filled)`),
      el("td", { "data-field": "unfilled" }, missing.map((g) => `${g.first}..${g.last}`).join(", ") || "none"),
      num(rank.replays, { "data-field": "replays" }),
      num(rank.restarts),
      num(rank.duplicates),
      rejectedCell,
      num(rank.store_errors),
      el("td", { class: "num" }, `${fmt(rank.lag_batches)} (${seconds(rank.lag_seconds ?? 0)})`),
      rate(rank.rates.batches),
      rate(rank.rates.gpu),
      el("td", {}, seen),
    );
  });
  $("#engine-ranks tbody").replaceChildren(...rows);
}

function showError(message) {
  $("#error").hidden = !message;
  $("#error").textContent = message ?? "";
}

async function engineStates() {
  const specs = await getJSON("engines");
  const answers = await Promise.allSettled(specs.map((s) => getJSON(`engines/${encodeURIComponent(s.name)}`)));
  // An engine removed between the two reads answers 404: it is simply gone.
  const failed = answers.find((a) => a.status === "rejected" && a.reason.status !== 404);
  if (failed) throw failed.reason;
  return answers.filter((a) => a.status === "fulfilled").map((a) => a.value);
}

function render(stats, states) {
  const now = Date.now();
  for (const engine of states) {
    for (const rank of engine.ranks) {
      rank.state = rankState(rank);
      rank.rates = recordRates(engine.name, rank, now);
    }
  }
  lastStates = states;
  renderSummary(stats, states);
  renderFleet(states);
  renderEngine(states);
  $("#updated").textContent = `updated ${new Date(now).toLocaleTimeString()}`;
}

async function poll() {
  let engines = lastStates.length;
  try {
    if (!document.hidden) {
      const [stats, states] = await Promise.all([getJSON("stats"), engineStates()]);
      render(stats, states);
      engines = states.length;
      showError(null);
    }
  } catch (e) {
    showError(`cannot read the API (${e.message}); retrying`);
  } finally {
    setTimeout(poll, Math.max(POLL_MS, engines * POLL_MS_PER_ENGINE));
  }
}

// --- prefix probe -------------------------------------------------------------------

function probeBody(form) {
  const by = form.by.value;
  const text = form.prompt.value;
  const model = form.model.value.trim();
  const filter = model ? `,"model":${JSON.stringify(model)}` : "";
  if (by === "prompt") return `{"prompt":${JSON.stringify(text)}${filter}}`;
  if (by === "messages") {
    let messages;
    try {
      messages = JSON.parse(text);
    } catch {
      throw new Error('chat messages are a JSON list: [{"role": "user", "content": "…"}]');
    }
    return `{"messages":${JSON.stringify(messages)}${filter}}`;
  }
  const items = text.split(/[\s,[\]]+/).filter(Boolean);
  if (by === "block_hashes") {
    // As strings: decimal uint64 hashes do not survive a JS number.
    return `{"block_hashes":${JSON.stringify(items)}${filter}}`;
  }
  const bad = items.find((t) => !/^\d+$/.test(t));
  if (bad !== undefined) throw new Error(`token ids are non-negative integers; ${JSON.stringify(bad)} is not`);
  // Written out as given (leading zeros dropped, which JSON refuses), not as JS numbers.
  return `{"tokens":[${items.map((t) => t.replace(/^0+(?=\d)/, "")).join(",")}]${filter}}`;
}

function renderProbe(answer) {
  const entries = answer.engines;
  const total =
    answer.num_blocks ??
    Math.max(1, ...entries.flatMap((e) => [e.prefix_blocks, e.gpu_blocks, e.cpu_blocks, e.storage_blocks]));
  const blocks = answer.num_blocks === null ? "blocks of mixed sizes" : `${fmt(answer.num_blocks)} blocks of ${answer.block_size} tokens`;
  const head = el("p", { class: "muted" }, `${blocks}; ${entries.length} ranks, best score first`);
  const rows = entries.map((e) => {
    const tiers = TIERS.map((t) => {
      const n = e[`${t.toLowerCase()}_blocks`];
      return el("div", { class: "tier", "data-tier": t }, el("span", {}, t), bar(t, n, total), el("span", { class: "num" }, `${fmt(n)} / ${fmt(total)} blocks`));
    });
    const label = el("div", {}, el("strong", {}, `${e.engine}/${e.dp_rank}`), e.degraded ? el("div", { class: "state-degraded" }, "degraded") : null);
    const prefix = el("div", { class: "muted", "data-field": "prefix" }, `prefix ${fmt(e.prefix_blocks)} blocks (${fmt(e.prefix_tokens)} tokens), score ${e.score.toFixed(1)}`);
    return el("div", { class: "probe-row", "data-engine": e.engine, "data-rank": e.dp_rank }, label, el("div", { class: "bars" }, ...tiers), prefix);
  });
  $("#probe-result").replaceChildren(head, ...rows);
}

async function probe(event) {
  event.preventDefault();
  const out = $("#probe-result");
  try {
    const body = probeBody(event.target);
    out.replaceChildren(el("p", { class: "muted" }, "matching…"));
    renderProbe(await getJSON("prefix-match", { method: "POST", headers: { "content-type": "application/json" }, body }));
  } catch (e) {
    out.replaceChildren(el("p", { class: "error" }, e.message));
  }
}

const PLACEHOLDERS = {
  tokens: "token ids, separated by commas or spaces",
  block_hashes: "block hashes (decimal uint64 or 0x-hex), separated by commas or spaces",
  prompt: "a completions prompt, tokenized as the model's vLLM does (give the model)",
  messages: 'chat messages as JSON: [{"role": "user", "content": "…"}] (give the model)',
};

// Text and chat prompts are offered when the server's schema takes them (a server
// without tokenizers still takes token ids and block hashes).
async function offerTextPrompts() {
  try {
    const schema = await getJSON("openapi.json");
    const fields = schema.components?.schemas?.PrefixMatchBody?.properties ?? {};
    const by = $("#probe-form select[name=by]");
    if ("prompt" in fields) by.append(new Option("text prompt", "prompt"));
    if ("messages" in fields) by.append(new Option("chat messages", "messages"));
  } catch {
    // token ids and block hashes still work
  }
}

// --- block lookup -------------------------------------------------------------------

async function lookup(event) {
  event.preventDefault();
  const hash = event.target.hash.value.trim();
  const out = $("#block-result");
  if (!hash) return;
  try {
    const answer = await getJSON(`blocks/${encodeURIComponent(hash)}`);
    if (!answer.residency.length) {
      out.replaceChildren(el("p", { class: "muted" }, `block ${answer.hash} is not resident on any engine`));
      return;
    }
    const columns = ["engine", "dp_rank", "medium", "ownership", "group_idx", "locality", "count"];
    const head = el("tr", {}, ...columns.map((c) => el("th", {}, c)));
    const rows = answer.residency.map((r) => el("tr", {}, ...columns.map((c) => el("td", { "data-field": c }, String(r[c] ?? "—")))));
    out.replaceChildren(el("p", { class: "muted" }, `block ${answer.hash}`), el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows)));
  } catch (e) {
    out.replaceChildren(el("p", { class: "error" }, e.message));
  }
}

// --- wiring -------------------------------------------------------------------------

function select(name) {
  selected = name;
  renderEngine(lastStates);
}

$("#engine-select").addEventListener("change", (e) => {
  location.hash = `engine=${encodeURIComponent(e.target.value)}`;
});
window.addEventListener("hashchange", () => select(decodeURIComponent(location.hash.replace(/^#engine=/, ""))));
$("#probe-form").addEventListener("submit", probe);
$("#probe-form select[name=by]").addEventListener("change", (e) => {
  e.target.form.prompt.placeholder = PLACEHOLDERS[e.target.value];
});
$("#block-form").addEventListener("submit", lookup);
offerTextPrompts();
poll();
