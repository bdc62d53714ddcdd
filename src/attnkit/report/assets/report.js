// attnkit report: sortable heads table and the token view. No network, no innerHTML
// with data: every token reaches the page through textContent.
(function () {
  "use strict";

  function sortTable(table, col, th) {
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var asc = th.getAttribute("aria-sort") !== "ascending";
    var numeric = th.getAttribute("data-type") === "number";
    rows.sort(function (a, b) {
      var x = a.cells[col].getAttribute("data-v"), y = b.cells[col].getAttribute("data-v");
      var c;
      if (numeric) {
        x = x === "" ? -Infinity : parseFloat(x);
        y = y === "" ? -Infinity : parseFloat(y);
        c = x - y;
      } else {
        c = x < y ? -1 : x > y ? 1 : 0;
      }
      return asc ? c : -c;
    });
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", asc ? "ascending" : "descending");
    rows.forEach(function (r) { body.appendChild(r); });
  }

  function setupTables() {
    Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
      Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
        th.addEventListener("click", function () { sortTable(table, col, th); });
      });
    });
  }

  function setupTokenView() {
    var holder = document.getElementById("attnkit-data");
    var view = document.getElementById("token-view");
    if (!holder || !view) return;
    var data = JSON.parse(holder.textContent);
    var select = view.querySelector("select");
    var box = view.querySelector(".tokens");
    var info = view.querySelector(".info");
    data.heads.forEach(function (h, i) {
      var opt = document.createElement("option");
      opt.value = String(i);
      opt.textContent = "layer " + h.layer + ", head " + h.head + " (" + h.label + ")";
      select.appendChild(opt);
    });
    // Show words, not pieces. WordPiece marks a continuation ("##ing"); SentencePiece and
    // byte-level BPE mark a word start ("\u2581the", "\u0120the") instead.
    var wordStart = /^[\u2581\u0120]/;
    var marksStarts = data.tokens.some(function (t) { return wordStart.test(t); });
    var spans = data.tokens.map(function (tok, i) {
      var s = document.createElement("span");
      var text = tok, gap;
      if (marksStarts) {
        gap = wordStart.test(text);
        if (gap) text = text.slice(1);
      } else {
        gap = !(text.indexOf("##") === 0 && text.length > 2);
        if (!gap) text = text.slice(2);
      }
      if (!text) text = "\u00a0";
      if (gap && i > 0) box.appendChild(document.createTextNode(" "));
      s.className = "tok";
      s.textContent = text;
      s.title = "token " + i + ": " + tok;
      s.tabIndex = 0;
      s.setAttribute("data-i", String(i));
      box.appendChild(s);
      return s;
    });

    function clear() {
      spans.forEach(function (s) { s.style.backgroundColor = ""; s.classList.remove("focus"); });
    }

    function show(i) {
      var h = data.heads[parseInt(select.value, 10)];
      clear();
      var row = i - h.q_start;
      spans[i].classList.add("focus");
      view.setAttribute("data-focus", h.layer + "." + h.head + ":" + i);
      if (row < 0 || row >= h.index.length) {
        info.textContent = "token " + i + " is not a query of this head's measurement";
        return;
      }
      var idx = h.index[row], w = h.weight[row];
      var top = w.length ? Math.max.apply(null, w) : 0;
      var parts = [];
      for (var j = 0; j < idx.length; j++) {
        if (idx[j] < 0) continue;
        var a = top > 0 ? w[j] / top : 0;
        spans[idx[j]].style.backgroundColor = "rgba(49, 104, 142, " + (0.15 + 0.75 * a).toFixed(3) + ")";
        parts.push(data.tokens[idx[j]] + " " + w[j].toFixed(3));
      }
      info.textContent = "“" + data.tokens[i] + "” (" + i + ") attends to: " + parts.join(", ");
    }

    box.addEventListener("mouseover", function (e) {
      var i = e.target.getAttribute && e.target.getAttribute("data-i");
      if (i !== null && i !== undefined) show(parseInt(i, 10));
    });
    box.addEventListener("focusin", function (e) {
      var i = e.target.getAttribute("data-i");
      if (i !== null) show(parseInt(i, 10));
    });
    select.addEventListener("change", function () { clear(); info.textContent = ""; view.removeAttribute("data-focus"); });

    // #token=LAYER.HEAD:I opens the view on one token (a link to share, and for tests)
    var m = /token=(\d+)\.(\d+):(\d+)/.exec(window.location.hash);
    if (m) {
      data.heads.forEach(function (h, k) {
        if (h.layer === parseInt(m[1], 10) && h.head === parseInt(m[2], 10)) select.value = String(k);
      });
      var t = parseInt(m[3], 10);
      if (t < spans.length) show(t);
    }
    view.setAttribute("data-ready", "1");
  }

  setupTables();
  setupTokenView();
  document.body.setAttribute("data-ready", "1");
})();
