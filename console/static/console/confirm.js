// Buttons with data-confirm ask before their form is sent. A listener here rather than
// an inline onclick: the pages' Content-Security-Policy allows no inline script.
(function () {
  "use strict";
  document.addEventListener("click", function (event) {
    const button = event.target.closest("button[data-confirm]");
    if (button && !window.confirm(button.dataset.confirm)) event.preventDefault();
  });
})();
