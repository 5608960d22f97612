// rmqtx ui: each page fetches its view from /api/<view> (what `rmqtx status <view> --json`
// prints) and draws it; every page refreshes itself. Every name shown comes from the store,
// which is anyone's input: text goes in with textContent, never as HTML.
"use strict";

const REFRESH_MS = 5000;
const AGE_BUCKETS = ["< 1 min", "1-10 min", "10-60 min", "> 1 h"];
const COLORS = ["#2f6fde", "#12b76a", "#f79009", "#7a5af8", "#ee46bc", "#06aed4", "#667085"];
let timer = null;
let charts = [];

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function count(n) { return n === null || n === undefined ? "-" : Number(n).toLocaleString("en-US"); }

function duration(seconds) {  // as rmqtx writes it (format_duration)
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 10) return `${seconds.toFixed(1)} s`;
  if (seconds < 120) return `${Math.round(seconds)} s`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min`;
  const hours = seconds / 3600;
  if (hours < 10) return `${hours.toFixed(1)} h`;
  return hours < 100 ? `${Math.round(hours)} h` : `${(seconds / 86400).toFixed(1)} d`;
}

function ago(view, iso) {
  if (!iso) return "never";
  return `${duration(Math.max(0, (Date.parse(view.generated) - Date.parse(iso)) / 1000))} ago`;
}

function size(bytes) {
  for (const [unit, scale] of [["GB", 2 ** 30], ["MB", 2 ** 20], ["KB", 2 ** 10]]) {
    if (bytes >= scale) return `${(bytes / scale).toFixed(1)} ${unit}`;
  }
  return `${bytes} B`;
}

function table(columns, rows, rowClass = () => "") {
  const head = el("tr", {}, ...columns.map(([name, numeric]) => el("th", numeric ? { class: "num" } : {}, name)));
  const body = rows.map((row) =>
    el("tr", { class: rowClass(row) }, ...row.map((cell, i) => el("td", columns[i][1] ? { class: "num" } : {}, cell))));
  return el("table", { class: "data" }, el("thead", {}, head), el("tbody", {}, ...body));
}

function card(label, value, level = "") {
  return el("div", { class: `card ${level}`, "data-card": label }, el("div", { class: "label" }, label), el("div", { class: "value" }, value));
}

// A chart with uPlot: x in seconds since the epoch, one line (or bar) series per name.
function chart(title, x, series, { bars = false, xLabels = null } = {}) {
  const box = el("div", { class: "chart", "data-chart": title }, el("div", { class: "title" }, title));
  if (!x.length || !series.length) {
    box.append(el("div", { class: "empty" }, "no data yet"));
    return box;
  }
  const width = Math.max(480, Math.min(680, (document.body.clientWidth - 90) / 2));
  const opts = {
    width, height: 220,
    scales: {
      x: xLabels ? { time: false, range: [-0.5, xLabels.length - 0.5] }
        // One point: five minutes around it (uPlot would span years).
        : x.length === 1 ? { time: true, range: [x[0] - 300, x[0] + 300] } : { time: true },
    },
    axes: [xLabels ? { values: (u, ticks) => ticks.map((t) => xLabels[t] ?? "") } : {}, {}],
    series: [{}, ...series.map(([name], i) => ({
      label: name, stroke: COLORS[i % COLORS.length], width: 2,
      fill: bars ? COLORS[i % COLORS.length] + "99" : undefined,
      paths: bars ? uPlot.paths.bars({ size: [0.6, 60] }) : undefined,
      points: { show: bars ? false : x.length < 40 },
    }))],
  };
  charts.push(new uPlot(opts, [x, ...series.map(([, values]) => values)], box));
  box.dataset.points = String(x.length);
  return box;
}

const PAGES = {
  async overview(page) {
    const [status, topics] = await Promise.all([api("status"), api("topics")]);
    const pending = status.producer_groups.reduce((n, g) => n + g.pending_transactions, 0);
    const oldest = Math.max(0, ...status.producer_groups.map((g) => g.oldest_pending_age_seconds || 0));
    const lag = status.consumer_groups.reduce((n, g) => n + g.lag, 0);
    const run = status.last_check_back;
    page.append(el("div", { class: "cards" },
      card("topics", count(status.topics.length)),
      card("pending transactions", count(pending), pending ? "warn" : ""),
      card("oldest pending", duration(pending ? oldest : null), oldest > 600 ? "bad" : ""),
      card("consumer lag", count(lag), lag ? "warn" : ""),
      card("discards not re-driven", count(status.discards.not_redriven), status.discards.not_redriven ? "bad" : ""),
      card("last check-back", run ? `${run.status}, ${ago(status, run.started)}` : "never", run && run.status !== "finished" ? "bad" : "")));
    page.append(el("h2", {}, "Throughput"), el("div", { class: "charts" }, throughputChart(topics, true)));
    return status.store;
  },

  async groups(page) {
    const [view, lag] = await Promise.all([api("groups"), api("lag")]);
    const rows = view.groups.flatMap((g) => g.queues.map((q) => [
      g.consumer_group, g.reader, g.topic, q.queue_id, count(q.committed_offset), count(q.end_offset),
      count(q.lag), count(q.in_flight), ago(view, q.last_progress), count(q.expired_unread)]));
    page.append(el("h2", {}, "Consumer groups"), rows.length
      ? table([["consumer group"], ["reader"], ["topic"], ["queue", 1], ["committed", 1], ["end", 1], ["lag", 1], ["in flight", 1], ["last progress"], ["expired unread", 1]],
        rows, (r) => (r[6] !== "0" || r[9] !== "0" ? "lagging" : ""))
      : el("p", { class: "muted" }, "No consumer group has recorded progress (the source's consumerGroup option, or a RocketMQ consumer of rmqtx serve)."));
    const names = Object.keys(lag.series);
    const times = [...new Set(names.flatMap((n) => lag.series[n].map(([t]) => t)))].sort();
    const x = times.map((t) => Date.parse(t) / 1000);
    const series = names.map((n) => {
      const byTime = new Map(lag.series[n]);
      return [n, times.map((t) => (byTime.has(t) ? byTime.get(t) : null))];
    });
    page.append(el("h2", {}, "Lag over time"), el("div", { class: "charts" },
      chart(`lag, sampled every ${duration(lag.sample_seconds)} since the dashboard started`, x, series)));
    return view.store;
  },

  async transactions(page) {
    const view = await api("transactions");
    const groups = view.producer_groups;
    page.append(el("h2", {}, "Pending transactions by producer group"), groups.length
      ? table([["producer group"], ["pending", 1], ["messages", 1], ["oldest", 1], ...AGE_BUCKETS.map((b) => [b, 1]), ["by sinks", 1], ["committed 1 h", 1], ["rolled back 1 h", 1]],
        groups.map((g) => [g.producer_group, count(g.pending_transactions), count(g.pending_messages), duration(g.oldest_pending_age_seconds),
          ...AGE_BUCKETS.map((b) => count(g.pending_by_age[b])), count(g.in_running_sink_epochs + g.in_committed_sink_epochs + g.in_aborted_sink_epochs),
          count(g.committed_last_hour), count(g.rolled_back_last_hour)]),
        (r) => (r[1] !== "0" ? "lagging" : ""))
      : el("p", { class: "muted" }, "No producer group yet."));
    const d = view.discards;
    page.append(el("p", {}, `Discards: ${count(d.messages)} message(s) in ${count(d.transactions)} transaction(s), ${count(d.not_redriven)} not re-driven (rmqtx resume).`));
    const byAge = AGE_BUCKETS.map((b) => groups.reduce((n, g) => n + g.pending_by_age[b], 0));
    const runs = [...view.check_back_runs].reverse();
    page.append(el("div", { class: "charts" },
      chart("pending transactions by age", AGE_BUCKETS.map((_, i) => i), [["pending", byAge]], { bars: true, xLabels: AGE_BUCKETS }),
      chart("check-back runs: pending found and decided", runs.map((r) => Date.parse(r.started) / 1000),
        [["pending found", runs.map((r) => r.pending_found)], ["committed", runs.map((r) => r.committed)], ["rolled back", runs.map((r) => r.rolled_back)]])));
    page.append(el("h2", {}, "Check-back runs, newest first"), view.check_back_runs.length
      ? table([["started"], ["status"], ["took", 1], ["pending", 1], ["committed", 1], ["rolled back", 1], ["unknown", 1], ["unrouted", 1], ["checker errors", 1], ["discarded", 1]],
        view.check_back_runs.map((r) => [ago(view, r.started), r.status, duration(r.duration_seconds), count(r.pending_found), count(r.committed),
          count(r.rolled_back), count(r.unknown), count(r.unrouted), count(r.errors), count(r.discarded)]))
      : el("p", { class: "muted" }, "No check-back run yet (rmqtx check)."));
    return view.store;
  },

  async topics(page) {
    const view = await api("topics");
    page.append(el("h2", {}, "Topics"), view.topics.length
      ? table([["topic"], ["messages", 1], ["queues", 1], ["last min", 1], ["last hour", 1], ["rate (1 min)", 1], ["oldest stored"], ["kept for"]],
        view.topics.map((t) => [t.topic, count(t.messages), Object.keys(t.queues).length, count(t.last_minute), count(t.last_hour),
          `${(t.last_minute / 60).toFixed(1)}/s`, ago(view, t.oldest_stored), duration(t.expires_after_seconds)]))
      : el("p", { class: "muted" }, "No topic has messages yet."));
    page.append(el("h2", {}, "Throughput"), el("div", { class: "charts" }, throughputChart(view, false)));
    return view.store;
  },

  async store(page) {
    const view = await api("store");
    const r = view.retention;
    page.append(el("p", {}, `${view.shards.length} shard(s); messages kept ${duration(r.file_reserved_time_seconds)}, decided transactions ${duration(r.transaction_reserved_time_seconds)}, maintenance every ${duration(r.maintenance_interval_seconds)}.`));
    page.append(table([["shard", 1], ["table"], ["version", 1], ["files", 1], ["rows", 1], ["size", 1]],
      view.shards.flatMap((s) => Object.entries(s.tables).map(([name, t]) => [s.shard, name, t.version, count(t.files), count(t.rows), size(t.bytes)]))));
    return view.store;
  },
};

// Messages stored per minute over the last hour, per topic (the busiest six) or in total.
function throughputChart(view, total) {
  const end = Date.parse(view.generated) / 1000;  // bucket i ends (59 - i) minutes before
  const x = Array.from({ length: 60 }, (_, i) => end - (59 - i) * 60);
  const topics = [...view.topics].sort((a, b) => b.last_hour - a.last_hour).slice(0, 6);
  const series = total
    ? [["all topics", x.map((_, i) => view.topics.reduce((n, t) => n + t.per_minute[i], 0))]]
    : topics.map((t) => [t.topic, t.per_minute]);
  return chart("messages stored per minute, last hour", view.topics.length ? x : [], series);
}

async function api(name) {
  const response = await fetch(`/api/${name}`, { cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

async function show() {
  const name = (location.hash || "#overview").slice(1);
  const render = PAGES[name] || PAGES.overview;
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.dataset.page === name));
  const page = el("div", { "data-page": name });
  const old = charts;
  charts = [];
  try {
    document.getElementById("store").textContent = await render(page);
    document.getElementById("refreshed").textContent = `refreshed ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    page.replaceChildren(el("div", { class: "error" }, `Could not read the store: ${error.message}`));
  }
  old.forEach((c) => c.destroy());
  document.getElementById("page").replaceChildren(page);
  document.body.dataset.rendered = name;
  clearTimeout(timer);
  timer = setTimeout(show, REFRESH_MS);
}

window.addEventListener("hashchange", show);
show();
