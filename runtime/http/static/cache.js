// The cache page: polls /get_server_info (counters) and /cache/tree (the radix tree) and draws them.
// A report written by `radixserve cache-report` sets window.RADIXSERVE_SNAPSHOT = {tree, info} and is drawn
// from that alone, with no requests. Every string from the server goes into the DOM as text, never as HTML.
"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const COUNTER_MS = 2000, TREE_MS = 5000, HISTORY = 180, ROW = 26, MAX_NODES = 300;
  const HOUR_S = 3600;
  const snapshot = window.RADIXSERVE_SNAPSHOT || null;
  const state = { key: "", rid: "", text: false, history: [], tree: null, info: null, busy: {} };

  const $ = (id) => document.getElementById(id);
  const pct = (x) => (100 * x).toFixed(1) + "%";
  const num = (x) => Number(x).toLocaleString("en-US");

  function el(tag, attrs, text) {
    const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function age(seconds) {
    if (seconds < 1) return "just now";
    if (seconds < 120) return Math.round(seconds) + " s ago";
    if (seconds < 7200) return Math.round(seconds / 60) + " min ago";
    return (seconds / 3600).toFixed(1) + " h ago";
  }

  function setStatus(message, isError) {
    $("status").textContent = message;
    $("status").className = isError ? "error" : "";
  }

  // ---- fetching ----------------------------------------------------------------------------------
  async function getJSON(path) {
    const headers = state.key ? { Authorization: "Bearer " + state.key } : {};
    const response = await fetch(path, { headers: headers, cache: "no-store" });
    let body = null;
    try { body = await response.json(); } catch (e) { /* an error page without JSON */ }
    if (!response.ok) {
      const message = body && body.error ? body.error.message : "HTTP " + response.status;
      const error = new Error(message);
      error.status = response.status;
      throw error;
    }
    return body;
  }

  function treeURL() {
    const params = new URLSearchParams({ max_nodes: String(MAX_NODES) });
    if (state.text) params.set("detail", "text");
    if (state.rid) params.set("rid", state.rid);
    return "/cache/tree?" + params.toString();
  }

  async function poll(name, load) {
    if (state.busy[name]) return;
    state.busy[name] = true;
    try {
      await load();
      setStatus("updated " + new Date().toLocaleTimeString(), false);
    } catch (error) {
      const hint = error.status === 401 ? " (enter the API key above)" : "";
      setStatus(name + ": " + error.message + hint, true);
    } finally {
      state.busy[name] = false;
    }
  }

  const pollCounters = () => poll("counters", async () => {
    state.info = await getJSON("/get_server_info");
    recordHistory(state.info);
    renderCounters(state.info);
    renderHistory();
  });

  const pollTree = () => poll("tree", async () => {
    state.tree = await getJSON(treeURL());
    renderTree(state.tree);
  });

  // ---- counters ----------------------------------------------------------------------------------
  function recordHistory(info) {
    const cache = info.cache || {};
    const memory = info.memory || {};
    state.history.push({
      t: Date.now() / 1000, matched: cache.matched_tokens || 0, queried: cache.queried_tokens || 0,
      usage: info.token_usage || 0, evicted: ((cache.tree || {}).evicted_tokens) || 0, total: memory.total_tokens,
    });
    if (state.history.length > HISTORY) state.history.shift();
  }

  function renderCounters(info) {
    const cache = info.cache || {}, memory = info.memory || {};
    const hit = $("hit-rate");
    hit.textContent = pct(cache.hit_rate || 0);
    hit.dataset.value = String(cache.hit_rate || 0);
    $("hit-detail").textContent = num(cache.matched_tokens || 0) + " of " + num(cache.queried_tokens || 0) +
      " prompt tokens from the cache";
    const total = memory.total_tokens || 0, free = memory.free_tokens || 0, evictable = memory.evictable_tokens || 0;
    const used = Math.max(0, total - free - evictable);
    const usage = $("kv-in-use");
    usage.textContent = pct(info.token_usage || 0);
    usage.dataset.value = String(info.token_usage || 0);
    const segments = $("kv-bar").children;
    segments[0].style.width = total ? pct(used / total) : "0";
    segments[1].style.width = total ? pct(evictable / total) : "0";
    $("kv-detail").textContent = num(used) + " held, " + num(evictable) + " cached, " + num(free) +
      " free of " + num(total) + " slots";
    const evicted = (cache.tree || {}).evicted_tokens || 0;
    $("evictions").textContent = num(evicted);
    $("evictions").dataset.value = String(evicted);
    const h = state.history;
    const recent = h.length > 1 ? h[h.length - 1].evicted - h[h.length - 2].evicted : 0;
    $("evict-detail").textContent = h.length > 1 ? num(recent) + " in the last interval" : "";
    $("requests").textContent = (info.num_running_reqs || 0) + " running";
    $("requests-detail").textContent = (info.num_queued_reqs || 0) + " queued, " +
      num(info.num_requests || 0) + " served";
  }

  function renderHistory() {
    const svg = $("history");
    svg.replaceChildren();
    const width = svg.clientWidth || 800, height = 150, left = 34, right = 8, top = 8, bottom = 18;
    const plotW = width - left - right, plotH = height - top - bottom;
    svg.setAttribute("viewBox", "0 0 " + width + " " + height);
    for (const fraction of [0, 0.5, 1]) {
      const y = top + plotH * (1 - fraction);
      svg.appendChild(el("svg:line", { class: "axis", x1: left, x2: width - right, y1: y, y2: y }));
      svg.appendChild(el("svg:text", { x: 2, y: y + 3 }, (100 * fraction) + "%"));
    }
    const h = state.history;
    if (h.length < 2) {
      $("history-note").textContent = snapshot ? "(a report holds one moment; open /cache on the server for history)"
        : "(collecting: one sample every " + COUNTER_MS / 1000 + " s)";
      return;
    }
    $("history-note").textContent = "(the last " + Math.round(h[h.length - 1].t - h[0].t) + " s)";
    const t0 = h[0].t, span = Math.max(1, h[h.length - 1].t - t0);
    const x = (t) => left + plotW * (t - t0) / span;
    const y = (v) => top + plotH * (1 - Math.max(0, Math.min(1, v)));
    let maxEvicted = 1;
    for (let i = 1; i < h.length; i++) maxEvicted = Math.max(maxEvicted, h[i].evicted - h[i - 1].evicted);
    const windowed = [], cumulative = [], usage = [];
    for (let i = 0; i < h.length; i++) {
      const s = h[i];
      cumulative.push(x(s.t) + "," + y(s.queried ? s.matched / s.queried : 0));
      usage.push(x(s.t) + "," + y(s.usage));
      if (i === 0) continue;
      const queried = s.queried - h[i - 1].queried;
      if (queried > 0) windowed.push(x(s.t) + "," + y((s.matched - h[i - 1].matched) / queried));
      const evicted = s.evicted - h[i - 1].evicted;
      if (evicted > 0) {
        const barH = plotH * evicted / maxEvicted;
        svg.appendChild(el("svg:rect", { class: "evict", x: x(s.t) - 2, width: 4, y: top + plotH - barH, height: barH }));
      }
    }
    svg.appendChild(el("svg:polyline", { class: "cumulative", points: cumulative.join(" ") }));
    svg.appendChild(el("svg:polyline", { class: "usage", points: usage.join(" ") }));
    if (windowed.length) svg.appendChild(el("svg:polyline", { class: "window", points: windowed.join(" ") }));
  }

  // ---- the tree ----------------------------------------------------------------------------------
  function nodeColor(node, now, maxHits) {
    const seconds = Math.max(0, now - node.last_access);
    const recency = Math.min(1, Math.log1p(seconds) / Math.log1p(HOUR_S));
    const hue = 10 + 210 * recency;  // red-orange when just used, blue after an hour
    const heat = maxHits > 0 ? Math.log1p(node.hits) / Math.log1p(maxHits) : 0;
    return "hsl(" + hue.toFixed(0) + ", " + (45 + 40 * heat).toFixed(0) + "%, " + (80 - 38 * heat).toFixed(0) + "%)";
  }

  function renderTree(tree) {
    const root = $("namespaces");
    root.replaceChildren();
    const onPath = new Set(tree.path ? tree.path.node_ids : []);
    renderPathInfo(tree);
    if (!tree.namespaces.length) {
      root.appendChild(el("p", { class: "empty" }, "Nothing cached yet in the namespaces this key can see."));
    }
    for (const ns of tree.namespaces) root.appendChild(renderNamespace(ns, tree.time, onPath));
    root.dataset.loaded = String(Date.now());
  }

  function renderPathInfo(tree) {
    const info = $("path-info");
    info.className = "";
    if (!state.rid) { info.textContent = ""; return; }
    if (!tree.path) {
      info.className = "missing";
      info.textContent = "No request " + JSON.stringify(state.rid) + " in your namespaces (running, or among the " +
        "recently finished).";
      return;
    }
    const p = tree.path;
    info.textContent = "Request " + p.rid + (p.running ? " (running)" : " (finished)") + " in " + p.namespace + ": " +
      num(p.cached_tokens) + " of its " + num(p.num_tokens) + " tokens are cached, along " + p.node_ids.length +
      " node" + (p.node_ids.length === 1 ? "" : "s") + ".";
  }

  function renderNamespace(ns, now, onPath) {
    const section = el("section", { class: "namespace", "data-name": ns.name });
    section.appendChild(el("h2", {}, ns.name));
    const shown = ns.nodes.length;
    section.appendChild(el("div", { class: "facts" },
      num(ns.num_tokens) + " tokens in " + num(ns.num_nodes) + " nodes, " + ns.num_top_level + " at the top · hit rate " +
      pct(ns.hit_rate) + " (" + num(ns.matched_tokens) + " of " + num(ns.queried_tokens) + " tokens) · " +
      num(ns.evicted_tokens) + " evicted" + (ns.locked_tokens ? " · " + num(ns.locked_tokens) + " locked" : "") +
      (ns.truncated ? " · showing the " + shown + " heaviest nodes (tokens × hits)" : "")));
    if (!shown) {
      section.appendChild(el("p", { class: "empty" }, "No cached tokens (all evicted or flushed)."));
      return section;
    }
    const children = new Map();
    let maxDepth = 1, maxHits = 0;
    for (const node of ns.nodes) {
      if (!children.has(node.parent)) children.set(node.parent, []);
      children.get(node.parent).push(node);
      maxDepth = Math.max(maxDepth, node.depth + (node.omitted_children ? 1 : 0));
      maxHits = Math.max(maxHits, node.hits);
    }
    const width = Math.max(300, ($("tree-panel").clientWidth || 1000) - 30);
    const svg = el("svg:svg", { class: onPath.size ? "icicle highlighting" : "icicle", width: width,
      height: maxDepth * ROW + 2, viewBox: "0 0 " + width + " " + (maxDepth * ROW + 2) });
    const defs = el("svg:defs");
    const hatch = el("svg:pattern", { id: "hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse",
      patternTransform: "rotate(45)" });
    hatch.appendChild(el("svg:rect", { width: 6, height: 6, fill: "#f1f3f5" }));
    hatch.appendChild(el("svg:line", { x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#ced4da", "stroke-width": 3 }));
    defs.appendChild(hatch);
    svg.appendChild(defs);
    const scale = width / Math.max(1, ns.num_tokens);

    function place(nodes, x, depth, omittedCount, omittedTokens) {
      for (const node of nodes) {
        const w = node.subtree_tokens * scale;
        const classes = ["node"];
        if (node.lock_ref > 0) classes.push("locked");
        if (onPath.has(node.id)) classes.push("on-path");
        classes.push("tier-" + node.tier);
        const rect = el("svg:rect", { class: classes.join(" "), x: x, y: (depth - 1) * ROW + 1,
          width: Math.max(1, w), height: ROW - 2, fill: nodeColor(node, now, maxHits),
          "data-id": node.id, "data-depth": node.depth });
        rect.addEventListener("mousemove", (event) => showTooltip(event, node, now));
        rect.addEventListener("mouseleave", hideTooltip);
        svg.appendChild(rect);
        if (w > 46) {
          const label = node.text !== undefined ? node.text.replace(/\s+/g, " ").slice(0, Math.floor(w / 6))
            : num(node.tokens) + " tok · " + num(node.hits) + " hits";
          svg.appendChild(el("svg:text", { class: "label", x: x + 4, y: (depth - 1) * ROW + ROW / 2 + 4 }, label));
        }
        place(children.get(node.id) || [], x, depth + 1, node.omitted_children, node.omitted_tokens);
        x += w;
      }
      if (omittedCount > 0) {
        const w = Math.max(1, omittedTokens * scale);
        const rect = el("svg:rect", { class: "omitted", x: x, y: (depth - 1) * ROW + 1, width: w, height: ROW - 2,
          "data-depth": depth });
        rect.appendChild(el("svg:title", {}, omittedCount + " more node" + (omittedCount === 1 ? "" : "s") +
          " (" + num(omittedTokens) + " tokens) not shown"));
        svg.appendChild(rect);
      }
    }

    const top = children.get(-1) || [];
    const topTokens = top.reduce((sum, node) => sum + node.subtree_tokens, 0);
    place(top, 0, 1, ns.num_top_level - top.length, ns.num_tokens - topTokens);
    section.appendChild(svg);
    return section;
  }

  function showTooltip(event, node, now) {
    const tip = $("tooltip");
    tip.replaceChildren();
    tip.appendChild(document.createTextNode(
      num(node.tokens) + " tokens (prefix " + num(node.prefix_tokens) + ", subtree " + num(node.subtree_tokens) + ")\n" +
      num(node.hits) + " hits · last used " + age(now - node.last_access) + "\n" +
      (node.lock_ref > 0 ? "locked by " + node.lock_ref + " running request(s)" : "evictable") + " · tier " + node.tier +
      (node.omitted_children ? "\n" + node.omitted_children + " child node(s) not shown" : "")));
    if (node.text !== undefined) {
      tip.appendChild(el("div", { class: "text" }, node.text + (node.text_truncated ? " …" : "")));
    }
    tip.hidden = false;
    tip.style.left = Math.min(event.clientX + 14, window.innerWidth - 430) + "px";
    tip.style.top = (event.clientY + 14) + "px";
  }

  function hideTooltip() { $("tooltip").hidden = true; }

  // ---- start -------------------------------------------------------------------------------------
  function readKeyFromHash() {
    const match = /(?:^#|&)key=([^&]*)/.exec(window.location.hash);
    if (!match) return;
    state.key = decodeURIComponent(match[1]);
    sessionStorage.setItem("radixserve-key", state.key);
    history.replaceState(null, "", window.location.pathname + window.location.search);  // keep it out of sight
  }

  function start() {
    $("rid-form").addEventListener("submit", (event) => {
      event.preventDefault();
      state.rid = $("rid").value.trim();
      if (snapshot) {
        const path = snapshot.tree.path && snapshot.tree.path.rid === state.rid ? snapshot.tree.path : null;
        renderTree(Object.assign({}, snapshot.tree, { path: path }));
      } else {
        pollTree();
      }
    });
    window.addEventListener("resize", () => { if (state.tree) renderTree(state.tree); renderHistory(); });
    if (snapshot) {
      document.body.classList.add("snapshot");
      state.tree = snapshot.tree;
      state.info = snapshot.info;
      state.rid = snapshot.tree.path ? snapshot.tree.path.rid : "";
      $("rid").value = state.rid;
      recordHistory(state.info);
      renderCounters(state.info);
      renderHistory();
      renderTree(state.tree);
      setStatus("report taken " + new Date(snapshot.tree.time * 1000).toLocaleString() + " from " + snapshot.url);
      return;
    }
    readKeyFromHash();
    state.key = state.key || sessionStorage.getItem("radixserve-key") || "";
    $("key").value = state.key;
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      state.key = $("key").value.trim();
      sessionStorage.setItem("radixserve-key", state.key);
      state.history = [];
      pollCounters();
      pollTree();
    });
    $("show-text").addEventListener("change", (event) => { state.text = event.target.checked; pollTree(); });
    pollCounters();
    pollTree();
    setInterval(pollCounters, COUNTER_MS);
    setInterval(pollTree, TREE_MS);
  }

  start();
})();
