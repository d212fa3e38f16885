// The dashboard page: polls /v1/dashboard/data and redraws. Drawing is DstackCharts'.
(function () {
  "use strict";
  var C = window.DstackCharts;
  var POLL_MS = 1500;
  var DASHES = ["", "6 3", "2 3", "8 3 2 3", "1 4"];
  var lastOk = 0;

  function $(id) { return document.getElementById(id); }

  // A colour square as SVG: the page's policy allows no inline style attributes.
  function swatch(color) {
    return '<svg class="sw" width="10" height="10"><rect width="10" height="10" rx="2" fill="' +
           color + '"/></svg>';
  }

  function legend(names, colorOf) {
    return names.map(function (n) {
      return '<span class="key">' + swatch(colorOf[n]) + C.esc(n) + "</span>";
    }).join("");
  }

  function refusalLines(models, colorOf) {
    var lines = [], rules = [];
    models.forEach(function (m) {
      Object.keys(m.refused_rps).forEach(function (r) {
        if (rules.indexOf(r) < 0) rules.push(r);
        if (m.refused_rps[r].some(function (v) { return v; })) {
          lines.push({label: m.name + " · " + r, color: colorOf[m.name],
                      dash: DASHES[rules.indexOf(r) % DASHES.length], values: m.refused_rps[r]});
        }
      });
    });
    var keys = rules.map(function (r, i) {
      return '<span class="key"><svg width="26" height="8"><line x1="0" y1="4" x2="26" y2="4" ' +
             'class="line" stroke="#555"' + (DASHES[i % DASHES.length] ? ' stroke-dasharray="' +
             DASHES[i % DASHES.length] + '"' : "") + "/></svg>" + C.esc(r) + "</span>";
    }).join("");
    return {lines: lines, keys: keys};
  }

  function charts(d, colorOf) {
    var win = d.window_s;
    function per(field, dash) {
      return d.models.map(function (m) {
        return {label: m.name, color: colorOf[m.name], values: m[field], dash: dash};
      });
    }
    var batch = per("batch").concat(per("batch_cap", "4 3"));
    var p99 = per("p99_ms");
    var ref = refusalLines(d.models, colorOf);
    var panels = [
      ["Goodput (answers within SLO / s)", C.lineSvg(d.t, per("goodput_rps"), {windowS: win})],
      ["SLO attainment (within SLO / finished)", C.lineSvg(d.t, per("attainment"), {windowS: win, yMax: 1})],
      ["p99 latency (ms, last " + d.p99_window_s + " s)", C.lineSvg(d.t, p99, {windowS: win})],
      ["Queue depth (queued or running)", C.lineSvg(d.t, per("queue"), {windowS: win})],
      ["Refusals / s by reason " + ref.keys, C.lineSvg(d.t, ref.lines, {windowS: win})],
      ["Batch size (mean run; dashed: policy's cap)", C.lineSvg(d.t, batch, {windowS: win})],
    ];
    return panels.map(function (p) {
      return '<figure class="panel"><figcaption>' + p[0] + "</figcaption>" + p[1] + "</figure>";
    }).join("");
  }

  function table(d, colorOf) {
    var n10 = Math.max(1, Math.round(10 / d.interval_s)), n60 = Math.max(1, Math.round(60 / d.interval_s));
    var rows = d.models.map(function (m) {
      var refused = Object.keys(m.refused_rps).map(function (r) {
        var k = C.recent(m.refused_rps[r], n60);
        return k ? C.esc(r) + " " + C.fmt(k) : "";
      }).filter(Boolean).join(", ") || "none";
      var cap = m.batch_cap.length ? m.batch_cap[m.batch_cap.length - 1] : null;
      return "<tr><td>" + swatch(colorOf[m.name]) + C.esc(m.name) +
        "</td><td>" + C.fmt(m.slo_ms) + "</td><td>" + C.fmt(m.slice_percent) +
        "</td><td>" + C.fmt(C.recent(m.goodput_rps, n10)) +
        "</td><td>" + C.fmt(C.recent(m.attainment, n60) === null ? null : 100 * C.recent(m.attainment, n60), 1) +
        "</td><td>" + C.fmt(m.p99_ms.length ? m.p99_ms[m.p99_ms.length - 1] : null) +
        "</td><td>" + C.fmt(m.queue.length ? m.queue[m.queue.length - 1] : null, 0) +
        "</td><td>" + C.fmt(C.recent(m.batch, n10)) + " / " + C.fmt(cap, 0) +
        "</td><td>" + refused +
        "</td><td>" + m.totals.success + " / " + m.totals.slo_met + "</td></tr>";
    }).join("");
    return "<table><thead><tr><th>model</th><th>SLO ms</th><th>slice %</th><th>goodput /s (10 s)</th>" +
      "<th>attainment % (60 s)</th><th>p99 ms</th><th>queue</th><th>batch / cap</th>" +
      "<th>refused /s (60 s)</th><th>answered / within SLO</th></tr></thead><tbody>" + rows + "</tbody></table>";
  }

  function draw(d) {
    var names = d.models.map(function (m) { return m.name; });
    var colorOf = C.colors(names);
    $("policy").textContent = d.policy;
    if (d.schedule && d.schedule.slots.length) {
      $("cycle-title").textContent = "Cycle: " + C.fmt(d.schedule.cycle_ms) + " ms";
      $("schedule").innerHTML = C.scheduleSvg(d.schedule, colorOf);
    } else {
      $("cycle-title").textContent = "Cycle";
      $("schedule").innerHTML = '<p class="note">Policy ' + C.esc(d.policy) +
        " runs no fixed cycle: each model runs whenever it has work, on its slice (table).</p>";
    }
    $("legend").innerHTML = legend(names, colorOf);
    $("table").innerHTML = table(d, colorOf);
    $("charts").innerHTML = charts(d, colorOf);
    $("window").textContent = Math.round(d.window_s / 60) + " min";
  }

  function tick() {
    fetch("/v1/dashboard/data", {cache: "no-store"})
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(function (d) { draw(d); lastOk = Date.now(); $("status").textContent = "live"; $("status").className = "ok"; })
      .catch(function (e) {
        $("status").textContent = "no data: " + e.message + (lastOk ? " (last " +
          Math.round((Date.now() - lastOk) / 1000) + " s ago)" : "");
        $("status").className = "bad";
      })
      .finally(function () { setTimeout(tick, POLL_MS); });
  }
  tick();
})();
