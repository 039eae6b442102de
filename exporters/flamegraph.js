// Interactive behaviour of aiflame's flame graph SVGs: details on hover, click to zoom, regex search
// (with the share of samples matched), and `globalThis.aiflame`, the same actions for scripts.
// exporters/svg.py embeds this file in every SVG and then calls aiflameInit(config) with the layout
// constants it used. Each frame is <g class="f" data-samples=N><title/><rect/><text/></g>; the frame's
// label is its title minus the " (N unit, P%)" suffix.
"use strict";

function aiflameInit(config) {
  const byId = (id) => document.getElementById(id);
  const framesGroup = byId("frames");
  const details = byId("details");
  const unzoomButton = byId("unzoom");
  const searchButton = byId("search");
  const caseButton = byId("ignorecase");
  const matchedText = byId("matched");
  const avail = config.width - 2 * config.xpad;
  const charWidth = config.fontSize * config.fontWidth;

  const frames = [];
  const recordOf = new Map();
  for (const g of framesGroup.getElementsByClassName("f")) {
    const title = g.getElementsByTagName("title")[0];
    const rect = g.getElementsByTagName("rect")[0];
    const text = g.getElementsByTagName("text")[0];
    const samples = g.getAttribute("data-samples");
    const titleText = title.textContent;
    const cut = titleText.lastIndexOf(" (" + samples + " ");
    const record = {
      g: g,
      rect: rect,
      text: text,
      titleText: titleText,
      label: cut >= 0 ? titleText.substring(0, cut) : titleText,
      samples: Number(samples),
      x: parseFloat(rect.getAttribute("x")),
      w: parseFloat(rect.getAttribute("width")),
      y: parseFloat(rect.getAttribute("y")),
      fill: rect.getAttribute("fill"),
      shownText: text.textContent,
    };
    frames.push(record);
    recordOf.set(g, record);
  }

  let zoomed = false;
  let searchTerm = null;
  let ignoreCase = false;

  function frameOf(el) {
    while (el && el !== framesGroup) {
      if (el.classList && el.classList.contains("f")) return recordOf.get(el);
      el = el.parentNode;
    }
    return undefined;
  }

  // Same rule as svg.py's _fit_text, so a reset zoom looks exactly like the rendered file.
  function fitText(label, width) {
    const chars = Math.floor((width - 3) / charWidth);
    if (chars < 3) return "";
    return label.length > chars ? label.substring(0, chars - 2) + ".." : label;
  }

  function place(f, x, w) {
    f.rect.setAttribute("x", x.toFixed(2));
    f.rect.setAttribute("width", w.toFixed(2));
    f.text.setAttribute("x", (x + 3).toFixed(2));
    f.text.textContent = fitText(f.label, w);
  }

  // Nearer the root than `t`: below it in a flame graph, above it in an icicle graph.
  function rootward(f, t) {
    return config.inverted ? f.y < t.y : f.y > t.y;
  }

  // Midpoints rather than edges: coordinates are rounded to 0.01 px, so edges of nested frames can
  // disagree slightly, but a frame's midpoint is always well inside its ancestors.
  function zoom(t) {
    if (!(t.w > 0)) return;
    const scale = avail / t.w;
    const tmid = t.x + t.w / 2;
    for (const f of frames) {
      const cls = f.g.classList;
      cls.remove("hide", "parent");
      if (rootward(f, t)) {
        if (f.x <= tmid && tmid <= f.x + f.w) {
          cls.add("parent");
          place(f, config.xpad, avail);
        } else {
          cls.add("hide");
        }
      } else {
        const mid = f.x + f.w / 2;
        if (mid >= t.x && mid <= t.x + t.w) {
          place(f, config.xpad + (f.x - t.x) * scale, f.w * scale);
        } else {
          cls.add("hide");
        }
      }
    }
    zoomed = true;
    unzoomButton.classList.remove("hide");
  }

  function unzoom() {
    if (!zoomed) return;
    for (const f of frames) {
      f.g.classList.remove("hide", "parent");
      f.rect.setAttribute("x", f.x.toFixed(2));
      f.rect.setAttribute("width", f.w.toFixed(2));
      f.text.setAttribute("x", (f.x + 3).toFixed(2));
      f.text.textContent = f.shownText;
    }
    zoomed = false;
    unzoomButton.classList.add("hide");
  }

  function clearHighlights() {
    for (const f of frames) f.rect.setAttribute("fill", f.fill);
  }

  function resetSearch() {
    clearHighlights();
    searchTerm = null;
    matchedText.textContent = " ";
    searchButton.textContent = "Search";
    searchButton.classList.remove("on");
  }

  // Share of all samples under matching frames; a match nested in another match counts once.
  function matchedPercent(hits) {
    hits.sort((a, b) => a.x - b.x || b.w - a.w || (rootward(a, b) ? -1 : 1));
    let sum = 0;
    let end = -Infinity;
    for (const f of hits) {
      // Flame graph frames are either nested or disjoint, so one left-to-right sweep finds the top ones.
      if (f.x + f.w / 2 < end) continue;
      sum += f.samples;
      end = f.x + f.w;
    }
    return config.total > 0 ? (100 * sum) / config.total : 0;
  }

  function search(term) {
    let re;
    try {
      re = new RegExp(term, ignoreCase ? "i" : "");
    } catch (err) {
      alert("Invalid regular expression: " + err.message);
      return;
    }
    clearHighlights();
    const hits = [];
    for (const f of frames) {
      if (re.test(f.label)) {
        f.rect.setAttribute("fill", config.matchColour);
        hits.push(f);
      }
    }
    searchTerm = term;
    searchButton.textContent = "Reset Search";
    searchButton.classList.add("on");
    matchedText.textContent = "Matched: " + matchedPercent(hits).toFixed(1) + "%";
  }

  function promptSearch() {
    const term = prompt("Enter a search term (regexp allowed, e.g. ^ext4_)" +
      (ignoreCase ? ", ignoring case" : "") + ". Escape resets.", searchTerm || "");
    if (term) search(term);
  }

  function toggleCase() {
    ignoreCase = !ignoreCase;
    caseButton.classList.toggle("on", ignoreCase);
    if (searchTerm !== null) search(searchTerm);
  }

  framesGroup.addEventListener("click", (e) => {
    const f = frameOf(e.target);
    if (f) zoom(f);
  });
  framesGroup.addEventListener("mouseover", (e) => {
    const f = frameOf(e.target);
    if (f) details.textContent = "Function: " + f.titleText;
  });
  framesGroup.addEventListener("mouseout", () => {
    details.textContent = " ";
  });
  unzoomButton.addEventListener("click", unzoom);
  searchButton.addEventListener("click", () => {
    if (searchTerm !== null) resetSearch();
    else promptSearch();
  });
  caseButton.addEventListener("click", toggleCase);
  // The same actions for scripts (the browser test drives these; users may call them from the console).
  globalThis.aiflame = {
    search: search,
    resetSearch: resetSearch,
    toggleCase: toggleCase,
    unzoom: unzoom,
    zoomTo: (label) => {
      const f = frames.find((r) => r.label === label);
      if (f) zoom(f);
      return Boolean(f);
    },
    matched: () => matchedText.textContent,
    visible: () => frames.filter((f) => !f.g.classList.contains("hide")).map((f) => ({
      label: f.label,
      x: parseFloat(f.rect.getAttribute("x")),
      w: parseFloat(f.rect.getAttribute("width")),
      y: f.y,
      fill: f.rect.getAttribute("fill"),
    })),
  };
  document.addEventListener("keydown", (e) => {
    const key = e.key;
    if (((e.ctrlKey || e.metaKey) && (key === "f" || key === "F")) || key === "F3") {
      e.preventDefault();
      promptSearch();
    } else if ((e.ctrlKey || e.metaKey) && (key === "i" || key === "I")) {
      e.preventDefault();
      toggleCase();
    } else if (key === "Escape") {
      if (searchTerm !== null) resetSearch();
      else unzoom();
    }
  });
}
