// A restore's progress, live: each restore.updated event for this job on /ws/fleet/ has
// the page rendered again on the server and its progress swapped in (MirbadSocket.resync),
// so the live page always equals a reload. Also on every (re)connect.
(function () {
  "use strict";
  const table = document.getElementById("restore-steps");
  if (!table || !window.MirbadSocket) return;
  const job = Number(table.dataset.job);
  const regions = ["#restore-steps", "#restore-state", "#restore-applied"];
  let pending = false;
  function refresh() {
    if (pending) return;
    pending = true;
    // Several steps move within a second while a download runs: one render for them.
    setTimeout(function () {
      pending = false;
      MirbadSocket.resync(regions);
    }, 250);
  }
  MirbadSocket.connect("/ws/fleet/", function (event) {
    if (event.type === "restore.updated" && event.jobId === job) refresh();
  }, refresh);
})();
