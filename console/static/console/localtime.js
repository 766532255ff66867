// <time datetime="ISO" data-local> elements shown in the browser's own time zone
// (the server renders UTC; an operator reads an expiry in local time).
(function () {
  "use strict";
  for (const el of document.querySelectorAll("time[data-local]")) {
    const at = new Date(el.getAttribute("datetime"));
    if (!isNaN(at.getTime())) {
      el.textContent = at.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "short" });
      el.title = el.getAttribute("datetime");
    }
  }
})();
