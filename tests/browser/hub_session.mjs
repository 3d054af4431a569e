// A learner's first minutes in the room's hub, for tests/test_hub.py: log in, start a server from
// the form (a Slurm job), open a course notebook in JupyterLab through the hub's proxy, run its
// first code cell, then try another learner's server. Prints one JSON line (the last line of
// stdout); exits 0 whenever it could report, 1 when the driver itself broke.
//
//   node hub_session.mjs --hub http://127.0.0.1:PORT --user NAME --password-env VAR \
//        --notebook notebooks/00_setup.ipynb --other NAME --out DIR [--chromium PATH]
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';

import { launch } from './chromium.mjs';

const { values: opt } = parseArgs({
  options: {
    hub: { type: 'string' }, user: { type: 'string' }, 'password-env': { type: 'string' },
    notebook: { type: 'string' }, other: { type: 'string' }, out: { type: 'string' },
    chromium: { type: 'string', default: '/usr/bin/chromium' },
    tag: { type: 'string', default: 'dpcourse-hub-test' },
  },
});
mkdirSync(opt.out, { recursive: true });
const password = process.env[opt['password-env']];  // never on a command line
const result = { logged_in: false, form_fields: [], spawn_s: null, lab_url: null, cell_output: null,
                 execution_count: null, other: null, screenshots: [], page_errors: [] };
const shot = async (page, name) => {
  const path = join(opt.out, `${name}.png`);
  await page.screenshot({ path }).then(() => result.screenshots.push(path), () => {});
};

let browser, page;
try {
  browser = await launch(opt.chromium, opt.tag);
  page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
  page.setDefaultTimeout(60_000);
  page.on('pageerror', (e) => result.page_errors.push(String(e).slice(0, 300)));

  // Log in with the learner's Unix password (PAM), as a learner would.
  await page.goto(`${opt.hub}/hub/login`);
  await page.fill('#username_input', opt.user);
  await page.fill('#password_input', password);
  await Promise.all([page.waitForNavigation(), page.click('#login_submit')]);
  result.logged_in = !page.url().includes('/hub/login');

  // The spawn form: the room's defaults are filled in; the learner keeps them and clicks Start.
  await page.waitForSelector('form#spawn_form');
  result.form_fields = await page.$$eval('form#spawn_form input[name]', (els) =>
    els.filter((e) => e.type !== 'hidden').map((e) => ({ name: e.name, value: e.value })));
  await shot(page, 'hub-form');
  const clicked = Date.now();
  await page.click('form#spawn_form [type=submit]');
  // The hub's progress page, then JupyterLab once the Slurm job's server answers.
  await page.waitForURL(new RegExp(`/user/${opt.user}/lab`), { timeout: 300_000 });
  await page.waitForSelector('#jp-main-dock-panel', { timeout: 120_000 });
  result.spawn_s = Math.round((Date.now() - clicked) / 100) / 10;
  result.lab_url = page.url();

  // A course notebook, from the learner's own copy; run its first code cell.
  await page.goto(`${opt.hub}/user/${opt.user}/lab/tree/${opt.notebook}`);
  const notebook = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  await notebook.locator('.jp-CodeCell').first().waitFor();
  // the status bar names the kernel once it has started, then its state (as run_notebook.mjs)
  await page.waitForFunction(() => {
    const bar = document.querySelector('#jp-main-statusbar');
    return bar && /\| Idle/.test(bar.innerText) && !/No Kernel/.test(bar.innerText);
  }, null, { timeout: 120_000, polling: 250 });
  const first = notebook.locator('.jp-CodeCell').first();
  await first.locator('.jp-InputPrompt').click();  // select the cell (command mode), as a learner
  await page.locator('.lm-MenuBar-item', { hasText: /^Run$/ }).click();
  await page.locator('.lm-Menu-item:not(.lm-mod-disabled)').filter({
    has: page.locator('.lm-Menu-itemLabel', { hasText: /^Run Selected Cell$/ }) }).click();
  await page.waitForFunction((el) => /\[\d+\]/.test(el.querySelector('.jp-InputPrompt').textContent),
    await first.elementHandle(), { timeout: 180_000, polling: 250 });
  const prompt = await first.locator('.jp-InputPrompt').innerText();
  result.execution_count = Number(/\[(\d+)\]/.exec(prompt)[1]);
  result.cell_output = (await first.locator('.jp-OutputArea').innerText()).slice(0, 2000);
  await shot(page, 'hub-notebook');

  // Another learner's server, with this learner's session: the hub must not let them in.
  const response = await page.goto(`${opt.hub}/user/${opt.other}/lab`);
  result.other = { status: response.status(), url: page.url(),
                   text: (await page.locator('body').innerText()).slice(0, 500) };
  await shot(page, 'hub-other');
} catch (e) {
  result.failure = String(e?.stack ?? e).slice(0, 2000);
  if (page) await shot(page, 'hub-failure');
} finally {
  if (browser) await browser.close().catch(() => {});
}
console.log(JSON.stringify(result));
