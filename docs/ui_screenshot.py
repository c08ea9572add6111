"""Makes docs/ui-episode.png, the README's picture of the results browser: an episode of the
demo (`make demo`) in headless Chromium (`make ui-screenshot` runs this after both).

    python docs/ui_screenshot.py [STORE] [OUT]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    from playwright.sync_api import sync_playwright

    from broker.settings import Settings
    from consumer.storage import open_store
    from interactor.ui.server import UIServer, open_source

    store_path = argv[0] if argv else str(ROOT / "runs/demo/results.sqlite")
    out = argv[1] if len(argv) > 1 else str(ROOT / "docs/ui-episode.png")
    store = open_store(store_path, readonly=True)
    # A guessing game won in a few turns: a whole conversation in one picture.
    rows = store.sql("SELECT episode_id FROM episodes WHERE env_name = 'guess_number' AND status = 'completed' "
                     "AND total_reward > 0 AND steps <= 5 ORDER BY steps DESC, episode_id LIMIT 1")
    store.close()
    if not rows:
        print(f"no completed guess_number episode in {store_path}: run `make demo` first", file=sys.stderr)
        return 2
    server = UIServer(open_source(Settings.from_env({}, store_url=store_path)), "127.0.0.1", 0).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium"))
            page = browser.new_page(viewport={"width": 1280, "height": 800}, device_scale_factor=1)
            page.goto(server.url + f"episodes/{rows[0][0]}")
            page.screenshot(path=out, full_page=True)
            browser.close()
    finally:
        server.stop()
    print(f"wrote {out} (episode {rows[0][0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
