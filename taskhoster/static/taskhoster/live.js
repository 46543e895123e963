/* Taskhoster's live admin pages (taskhoster/admin/live.py says how and why).
 *
 * A page that loads this script and has a status line `[data-th-live]` asks for its own
 * address again about once a second (the status line's value, in milliseconds) with the
 * header `X-Taskhoster-Live: 1`; the answer is `{"at", "regions": {name: html}}` and each
 * element `[data-th-region=name]` whose html changed is redrawn. Nothing is asked while the
 * tab is hidden, after an error it waits longer (up to 30 s), and it stops when the page is
 * gone (the item deleted, the session ended) and says so.
 */
"use strict";
(function () {
  const MAX_WAIT_MS = 30000;

  function start() {
    const status = document.querySelector("[data-th-live]");
    if (!status) {
      return;
    }
    const every = Math.max(250, Number(status.dataset.thLive) || 1000);
    const drawn = {};
    let failures = 0;
    let timer = null;
    let busy = false;

    function say(text, state) {
      status.textContent = text;
      status.dataset.thLiveState = state;
    }

    function schedule(ms) {
      if (timer === null) {
        timer = window.setTimeout(poll, ms);
      }
    }

    function draw(regions) {
      for (const [name, html] of Object.entries(regions)) {
        if (drawn[name] === html) {
          continue;
        }
        const places = document.querySelectorAll('[data-th-region="' + name + '"]');
        places.forEach(function (place) {
          place.innerHTML = html;
        });
        drawn[name] = html;
      }
    }

    async function poll() {
      timer = null;
      if (document.hidden || busy) {
        return; // visibilitychange starts it again
      }
      busy = true;
      try {
        const response = await fetch(window.location.href, {
          headers: { "X-Taskhoster-Live": "1", Accept: "application/json" },
          credentials: "same-origin",
          cache: "no-store",
          redirect: "manual",
        });
        if (response.type === "opaqueredirect" || !response.ok) {
          throw new Error("HTTP " + (response.status || "redirect"));
        }
        const body = await response.json();
        if (body.gone) {
          say("Live updates stopped: this page is no longer there. Reload to see why.", "gone");
          return;
        }
        draw(body.regions || {});
        failures = 0;
        const at = new Date(body.at);
        say("Live: updated " + at.toLocaleTimeString(), "live");
      } catch (error) {
        failures += 1;
        say("Live updates paused (" + error.message + "); trying again.", "retrying");
      } finally {
        busy = false;
      }
      schedule(failures ? Math.min(every * 2 ** failures, MAX_WAIT_MS) : every);
    }

    document.addEventListener("visibilitychange", function () {
      if (!document.hidden) {
        schedule(0);
      }
    });
    say("Live", "live");
    schedule(every);
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
