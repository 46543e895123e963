/* Taskhoster's live admin pages (taskhoster/admin/live.py says how and why).
 *
 * A page that loads this script and has a status line `[data-th-live]` asks for its own
 * address again about once a second (the status line's value, in milliseconds) with the
 * header `X-Taskhoster-Live: 1`; the answer is `{"at", "regions": {name: html}}` and each
 * element `[data-th-region=name]` whose html changed is redrawn, unless the pointer or the
 * focus is on one of its controls. Nothing is asked while the tab is hidden, after an error
 * it waits longer (up to 30 s; an answer takes at most 10 s), and it stops for good when the
 * page is gone (the item deleted, the session ended, the permission taken) and says so.
 */
"use strict";
(function () {
  const MAX_WAIT_MS = 30000;
  const TIMEOUT_MS = 10000; // an answer slower than this is given up, and asked again later
  const FINAL = [401, 403, 404, 410];

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
    let stopped = false;

    function say(text, state) {
      status.textContent = text;
      status.dataset.thLiveState = state;
    }

    function schedule(ms) {
      if (timer === null && !stopped) {
        timer = window.setTimeout(poll, ms);
      }
    }

    // A region is not redrawn while the pointer is on one of its buttons, links or fields,
    // or one of them has the focus: a click must land on what the operator aimed at (the
    // rows below a closed socket move up), never on a row drawn under the pointer.
    function inUse(place) {
      const active = document.activeElement;
      return (
        place.querySelector("a:hover, button:hover, input:hover, select:hover, form:hover") !==
          null ||
        (active !== null && active !== document.body && place.contains(active))
      );
    }

    function draw(regions) {
      for (const [name, html] of Object.entries(regions)) {
        if (drawn[name] === html) {
          continue;
        }
        let all = true;
        document.querySelectorAll('[data-th-region="' + name + '"]').forEach(function (place) {
          if (inUse(place)) {
            all = false;
          } else {
            place.innerHTML = html;
          }
        });
        if (all) {
          drawn[name] = html;
        }
      }
    }

    function stop(text) {
      stopped = true;
      say(text, "stopped");
    }

    async function poll() {
      timer = null;
      if (document.hidden || busy) {
        return; // visibilitychange starts it again
      }
      busy = true;
      const abort = new AbortController();
      const limit = window.setTimeout(function () {
        abort.abort();
      }, TIMEOUT_MS);
      try {
        const response = await fetch(window.location.href, {
          headers: { "X-Taskhoster-Live": "1", Accept: "application/json" },
          credentials: "same-origin",
          cache: "no-store",
          redirect: "manual",
          signal: abort.signal,
        });
        if (response.type === "opaqueredirect" || FINAL.includes(response.status)) {
          // Signed out (the admin sends to its login page), or no longer allowed or there.
          stop("Live updates stopped: reload the page to sign in again or see why.");
          return;
        }
        if (!response.ok) {
          throw new Error("HTTP " + response.status);
        }
        const body = await response.json();
        if (body.gone) {
          stop("Live updates stopped: this page is no longer there. Reload to see why.");
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
        window.clearTimeout(limit);
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
