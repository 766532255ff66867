// One websocket per console page, reconnected with back-off (1 s doubling to 30 s).
// The page's badge #live says "live" or "reconnecting…" so an operator never reads a
// frozen page as a current one. Page scripts call
//   MirbadSocket.connect(path, function (event) { ... })
// where path is a /ws/... URL (nodes/events.py names the typed events it carries), and
// optionally pass onOpen, called after every (re)connect so a page can refetch what it
// may have missed while it was away. connect returns {send(object)}: a page that shows only
// some nodes or models sends {"type": "subscribe", ...} from onOpen (console/consumers.py),
// and again whenever its rows change; nothing is sent while the socket is closed.
(function () {
  "use strict";
  function connect(path, onEvent, onOpen) {
    const live = document.getElementById("live");
    let delay = 1000;
    let opened = false;
    let current = null;
    function say(text, cls) {
      if (!live) return;
      live.textContent = text;
      live.className = "badge " + cls;
    }
    function open() {
      const scheme = location.protocol === "https:" ? "wss://" : "ws://";
      const ws = new WebSocket(scheme + location.host + path);
      current = ws;
      ws.onopen = function () {
        say(opened ? "live (reconnected)" : "live", "s-live");
        opened = true;
        delay = 1000;
        if (onOpen) onOpen();
      };
      ws.onmessage = function (msg) {
        let event;
        try { event = JSON.parse(msg.data); } catch (e) { return; }
        onEvent(event);
      };
      ws.onclose = function (closed) {
        if (closed.code === 4400) {
          // The consumer refused what this page sent: reconnecting would repeat it.
          say("live updates refused (reload the page)", "s-lost");
          return;
        }
        say("connection lost, reconnecting…", "s-lost");
        setTimeout(open, delay);
        delay = Math.min(delay * 2, 30000);
      };
    }
    open();
    return {
      send: function (message) {
        if (current && current.readyState === WebSocket.OPEN) current.send(JSON.stringify(message));
      },
    };
  }
  // Render the page again on the server and swap in the elements ``selectors`` name: what
  // changed while the socket was not yet (or no longer) connected is not lost. Pages call
  // it from onOpen: an event published between the page's render and the socket's open
  // (a download that completes in 30 ms) would otherwise never reach it.
  function resync(selectors) {
    return fetch(location.href, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html === null) return;
        const fresh = new DOMParser().parseFromString(html, "text/html");
        for (const selector of selectors) {
          const mine = document.querySelector(selector);
          const theirs = fresh.querySelector(selector);
          if (mine && theirs) mine.replaceWith(document.importNode(theirs, true));
        }
      })
      .catch(function () { /* the next event or reconnect tries again */ });
  }

  window.MirbadSocket = { connect: connect, resync: resync };
})();
