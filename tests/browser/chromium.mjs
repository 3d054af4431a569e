// Debian's Chromium for the browser tests (run_notebook.mjs, hub_session.mjs), headless, on a closed
// network: no sandbox as root, nothing phoned home, loopback never through a proxy. `tag` is an
// unknown switch that Chromium ignores: the Python test finds this run's processes by it.
import { chromium } from 'playwright-core';

export function launch(executablePath, tag) {
  return chromium.launch({
    executablePath,
    args: ['--no-sandbox', '--disable-background-networking', '--disable-component-update',
           '--disable-default-apps', '--disable-sync', '--no-first-run', '--no-proxy-server',
           '--disable-dev-shm-usage', `--${tag}`],
  });
}
