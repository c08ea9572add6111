// The results browser's little JavaScript: live counts on the jobs pages (polling a JSON
// route; the server renders everything else) and the action token kept for this tab.
// Served by the package itself; the page's CSP allows no other script.
(function () {
  "use strict";

  var TOKEN_KEY = "interactor-action-token";

  function keepToken() {
    // `interactor ui --allow-actions` prints http://host:port/#token=...: the fragment never
    // reaches a server or a Referer. Keep it for this tab and take it out of the address bar.
    var m = /(?:^#|&)token=([^&]+)/.exec(window.location.hash);
    if (m) {
      try { sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1])); } catch (e) { /* private mode */ }
      history.replaceState(null, "", window.location.pathname + window.location.search);
    }
    var token = null;
    try { token = sessionStorage.getItem(TOKEN_KEY); } catch (e) { token = null; }
    document.querySelectorAll("form.action input[name=token]").forEach(function (input) {
      if (token && !input.value) {
        input.value = token;
        input.hidden = true;
      }
      input.form.addEventListener("submit", function () {
        if (input.value) {
          try { sessionStorage.setItem(TOKEN_KEY, input.value); } catch (e) { /* ignore */ }
        }
      });
    });
  }

  function fmtInt(x) { return x === null || x === undefined ? "-" : Number(x).toLocaleString("en-US"); }
  function fmtNum(x, nd) { return x === null || x === undefined ? "-" : Number(x).toFixed(nd); }

  function show(scope, p) {
    var text = {
      done: fmtInt(p.done), failed: fmtInt(p.failed), running: fmtInt(p.running), total: fmtInt(p.total),
      retrying: fmtInt(p.retrying), steps: fmtInt(p.steps), steps_per_s: fmtNum(p.steps_per_s, 1),
      mean_reward: fmtNum(p.mean_reward, 3), pct: (100 * p.progress).toFixed(1) + "%",
      state: p.active ? "running" : "finished"
    };
    // The jobs table counts retrying episodes as queued; the job pages show both.
    text.queued = fmtInt(scope.querySelector("[data-field=retrying]") ? p.queued : p.queued + p.retrying);
    scope.querySelectorAll("[data-field]").forEach(function (el) {
      var f = el.getAttribute("data-field");
      if (f === "progress") { el.value = p.progress; return; }
      if (Object.prototype.hasOwnProperty.call(text, f)) { el.textContent = text[f]; }
      if (f === "state") { el.className = "badge " + (p.active ? "warn" : "ok"); }
    });
  }

  function poll(url, apply, every) {
    var busy = false;
    function tick() {
      if (busy || document.hidden) { return; }
      busy = true;
      fetch(url, {headers: {"Accept": "application/json"}, credentials: "same-origin"})
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (data) { if (data) { apply(data); } })
        .catch(function () { /* the server is gone or restarting: try again next tick */ })
        .then(function () { busy = false; });
    }
    setInterval(tick, every);
  }

  function liveJobs() {
    var table = document.getElementById("jobs");
    if (!table) { return; }
    poll(table.getAttribute("data-poll"), function (data) {
      var seen = {};
      table.querySelectorAll("tr[data-job]").forEach(function (row) { seen[row.getAttribute("data-job")] = row; });
      var fresh = 0;
      data.jobs.forEach(function (p) {
        if (seen[p.job_id]) { show(seen[p.job_id], p); } else { fresh += 1; }
      });
      var note = document.getElementById("new-jobs");
      if (note && fresh) { note.hidden = false; }
      var fleet = document.getElementById("fleet");
      if (fleet && data.fleet) {
        fleet.querySelectorAll("[data-fleet]").forEach(function (el) {
          var f = el.getAttribute("data-fleet");
          el.textContent = f === "steps_per_s" ? fmtNum(data.fleet[f], 1) : fmtInt(data.fleet[f]);
        });
      }
    }, 2000);
  }

  function liveJob() {
    var line = document.querySelector("[data-live-job]");
    if (!line) { return; }
    var url = "/api/jobs/" + encodeURIComponent(line.getAttribute("data-live-job"));
    poll(url, function (p) { show(line, p); }, 2000);
  }

  document.addEventListener("DOMContentLoaded", function () {
    keepToken();
    liveJobs();
    liveJob();
  });
})();
