// Skipper web UI: live updates over Server-Sent Events and in-place
// filters. The server pushes `patch` events ({id, html}) when a part of the
// page changes; nothing here polls. Filters and sort headers change the
// query (history.replaceState) and reopen the stream, which answers with
// the filtered table at once.
(function () {
  "use strict";

  // Theme: system (default), light or dark, remembered in localStorage.
  var themes = ["system", "light", "dark"];
  function applyTheme(t) {
    if (t === "light" || t === "dark") {
      document.documentElement.setAttribute("data-theme", t);
    } else {
      document.documentElement.removeAttribute("data-theme");
    }
  }
  var stored = null;
  try { stored = window.localStorage.getItem("skipper-theme"); } catch (e) { stored = null; }
  applyTheme(stored);
  var themeButton = document.getElementById("theme");
  if (themeButton) {
    themeButton.title = "theme: " + (stored || "system");
    themeButton.addEventListener("click", function () {
      var current = themes.indexOf(stored || "system");
      stored = themes[(current + 1) % themes.length];
      try { window.localStorage.setItem("skipper-theme", stored); } catch (e) { /* private mode */ }
      applyTheme(stored);
      themeButton.title = "theme: " + stored;
    });
  }

  var base = document.body.getAttribute("data-sse");
  if (!base) { return; }
  var path = base.split("?")[0];
  var live = document.getElementById("live");
  var source = null;

  function setLive(state, text) {
    if (!live) { return; }
    live.className = "live " + state;
    live.textContent = text;
  }

  function connect() {
    if (source) { source.close(); }
    source = new EventSource(path + window.location.search);
    source.addEventListener("open", function () { setLive("on", "live"); });
    source.addEventListener("error", function () { setLive("off", "reconnecting"); });
    source.addEventListener("patch", function (e) {
      var m = JSON.parse(e.data);
      var el = document.getElementById(m.id);
      if (el) { el.innerHTML = m.html; }
    });
    source.addEventListener("failed", function (e) {
      var m = JSON.parse(e.data);
      setLive("off", "render error: " + m.message);
    });
  }

  // Filters: every named field of a [data-live-filter] form is a query
  // parameter; typing replaces the query and reopens the stream.
  var timer = null;
  function params() { return new URLSearchParams(window.location.search); }
  function update(p) {
    var q = p.toString();
    window.history.replaceState(null, "", q ? "?" + q : window.location.pathname);
    connect();
  }
  var form = document.querySelector("form[data-live-filter]");
  if (form) {
    form.addEventListener("submit", function (e) { e.preventDefault(); });
    var onChange = function (e) {
      var field = e.target;
      if (!field.name) { return; }
      window.clearTimeout(timer);
      timer = window.setTimeout(function () {
        var p = params();
        if (field.value) { p.set(field.name, field.value); } else { p.delete(field.name); }
        update(p);
      }, 150);
    };
    form.addEventListener("input", onChange);
    form.addEventListener("change", onChange);
  }
  // Sort headers: toggle the direction on the sorted column.
  document.addEventListener("click", function (e) {
    var a = e.target.closest ? e.target.closest("a[data-sort]") : null;
    if (!a) { return; }
    e.preventDefault();
    var p = params();
    var col = a.getAttribute("data-sort");
    var dir = a.classList.contains("sorted") && a.classList.contains("asc") ? "desc" : "asc";
    p.set("sort", col);
    p.set("dir", dir);
    if (form) {
      var s = form.querySelector("[name=sort]");
      var d = form.querySelector("[name=dir]");
      if (s) { s.value = col; }
      if (d) { d.value = dir; }
    }
    update(p);
  });

  window.addEventListener("pagehide", function () { if (source) { source.close(); } });
  connect();
}());
