// Copy buttons: <button data-copy-target="#id"> copies that element's text (an input's
// value) with navigator.clipboard. Where the clipboard is refused or absent (plain http
// on another host is not a secure context) the text is selected instead, for Ctrl+C.
// A listener here rather than an inline onclick: the pages' CSP allows no inline script.
(function () {
  "use strict";
  function select(target) {
    if (target instanceof HTMLInputElement || target instanceof HTMLTextAreaElement) {
      target.focus();
      target.select();
      return;
    }
    const range = document.createRange();
    range.selectNodeContents(target);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }

  function say(button, text) {
    if (!button.dataset.label) button.dataset.label = button.textContent;
    button.textContent = text;
    setTimeout(function () { button.textContent = button.dataset.label; }, 2000);
  }

  document.addEventListener("click", function (event) {
    const button = event.target.closest("button[data-copy-target]");
    if (!button) return;
    const target = document.querySelector(button.dataset.copyTarget);
    if (!target) return;
    const text = target instanceof HTMLInputElement || target instanceof HTMLTextAreaElement
      ? target.value : target.textContent;
    function fallback() {
      select(target);
      say(button, "Selected: press Ctrl+C");
    }
    if (!navigator.clipboard || !window.isSecureContext) {
      fallback();
      return;
    }
    navigator.clipboard.writeText(text).then(function () { say(button, "Copied"); }, fallback);
  });
})();
