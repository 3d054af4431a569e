// Drives headless Chromium through a running JupyterLab, for tests/test_browser.py:
// open one notebook, clear its outputs, Run All Cells, wait for every cell, look for error
// outputs, move the first widget's second slider one step and wait for its plot to redraw, save
// the notebook, and take screenshots. Prints one JSON line (the last line of stdout) that the
// Python test asserts on; exits 0 whenever it could report, 1 when the driver itself broke.
//
//   node run_notebook.mjs --url http://127.0.0.1:PORT --token TOKEN --notebook PATH \
//        --out DIR --cells N [--chromium /usr/bin/chromium] [--timeout SECONDS] [--tag NAME]
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';

import { launch } from './chromium.mjs';

const { values: opt } = parseArgs({
  options: {
    url: { type: 'string' }, token: { type: 'string' }, notebook: { type: 'string' },
    out: { type: 'string' }, cells: { type: 'string' },
    chromium: { type: 'string', default: '/usr/bin/chromium' },
    timeout: { type: 'string', default: '150' },  // seconds for the whole notebook to run
    tag: { type: 'string', default: 'dpcourse-browser-test' },  // marks this run's Chromium processes
  },
});
const cells = Number(opt.cells);  // how many the notebook has: all of them must be in the page
const runTimeout = Number(opt.timeout) * 1000;
mkdirSync(opt.out, { recursive: true });

const t0 = Date.now();
const seconds = () => Math.round((Date.now() - t0) / 100) / 10;
const result = {
  cells_rendered: 0, code_cells: 0, execution_counts: [], cells_run: 0, errors: [], page_errors: [],
  slider: null, slider_moved: false, plot_changed: false, saved: false, screenshots: [], timings: {},
};
const mark = (name) => { result.timings[name] = seconds(); };

let browser, page;
try {
  browser = await launch(opt.chromium, opt.tag);
  // JupyterLab scrolls inside the page: a tall window shows more of the notebook at once.
  page = await browser.newPage({ viewport: { width: 1400, height: 3000 } });
  page.setDefaultTimeout(60_000);
  page.on('pageerror', (e) => result.page_errors.push(String(e).slice(0, 500)));
  mark('browser');

  await page.goto(`${opt.url}/lab/tree/${encodeURI(opt.notebook)}?token=${opt.token}`);
  const notebook = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  // every cell in the DOM (the server's settings turn windowing off) and the kernel ready
  await page.waitForFunction((n) => document.querySelectorAll('.jp-Notebook .jp-Cell').length === n, cells);
  await waitKernelIdle(page, 120_000);
  result.cells_rendered = await notebook.locator('.jp-Cell').count();
  result.code_cells = await notebook.locator('.jp-CodeCell').count();
  mark('notebook_open');

  // Clear the committed outputs first, so that every number and plot seen below is this run's.
  await menu(page, 'Edit', 'Clear Outputs of All Cells');
  await page.waitForFunction(() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
    .every((p) => /^\[ ?\]:$/.test(p.textContent.trim())));
  await menu(page, 'Run', 'Run All Cells');
  // Done: no cell queued or running ([*]), at least one numbered, and the kernel idle. An error
  // stops the run: JupyterLab then puts the cells after it back to [ ] (counted as not run).
  await page.waitForFunction(() => {
    const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
      .map((p) => p.textContent.trim());
    return !prompts.some((p) => p.includes('*')) && prompts.some((p) => /^\[\d+\]:$/.test(p));
  }, null, { timeout: runTimeout, polling: 250 });
  await waitKernelIdle(page, 90_000);
  mark('run_all');

  const prompts = await notebook.locator('.jp-CodeCell .jp-InputPrompt').allTextContents();
  result.execution_counts = prompts.map((p) => { const m = /\[(\d+)\]/.exec(p); return m ? Number(m[1]) : null; });
  result.cells_run = result.execution_counts.filter((n) => n !== null).length;
  // JupyterLab 4 renders an exception as stderr text (data-mime-type application/vnd.jupyter.stderr,
  // like warnings and progress bars): an error is the one with a traceback. The Python test also
  // reads the saved notebook, where the output_type says "error".
  result.errors = await page.evaluate(() => {
    const isError = (out) => out.dataset.mimeType === 'application/vnd.jupyter.error'
      || (out.dataset.mimeType === 'application/vnd.jupyter.stderr'
          && /Traceback \(most recent call last\)/.test(out.innerText));
    return [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')]
      .map((cell, index) => ({ index, error: [...cell.querySelectorAll('.jp-OutputArea-output')].find(isError) }))
      .filter((c) => c.error)
      .map((c) => ({ code_cell: c.index, text: c.error.innerText.slice(-800) }));
  });

  // The widget: its cell has sliders (ipywidgets 8: noUiSlider) and an Output with the plot.
  const sliderCells = notebook.locator('.jp-CodeCell').filter({ has: page.locator('.widget-slider') });
  const widgetCell = sliderCells.first();
  if (await sliderCells.count() > 0) {
    const sliders = widgetCell.locator('.widget-slider');
    const slider = sliders.nth((await sliders.count()) > 1 ? 1 : 0);  // the batch size in notebook 01
    const plot = widgetCell.locator('.widget-output img, .jupyter-widgets-output-area img').first();
    await plot.waitFor();
    await page.waitForTimeout(300);  // let the first draw settle
    const before = { value: (await slider.locator('.widget-readout').innerText()).trim(),
                     src: await plot.getAttribute('src') };
    // Keyboard, as a learner without a mouse would: focus the handle, one step right. Should the
    // keys not move it, drag the handle with the mouse instead.
    const handle = slider.locator('.noUi-handle').first();
    const readout = await slider.locator('.widget-readout').elementHandle();
    const moved = () => page.waitForFunction(([el, v]) => el.innerText.trim() !== v,
      [readout, before.value], { timeout: 10_000 }).then(() => true, () => false);
    let method = 'keyboard';
    await handle.focus();
    await page.keyboard.press('ArrowRight');
    if (!(await moved())) {
      method = 'mouse';
      const box = await handle.boundingBox();
      await page.mouse.move(box.x + box.width / 2, box.y + box.height / 2);
      await page.mouse.down();
      await page.mouse.move(box.x + box.width / 2 + 30, box.y + box.height / 2, { steps: 5 });
      await page.mouse.up();
      await moved();
    }
    const after = { value: (await slider.locator('.widget-readout').innerText()).trim() };
    result.slider_moved = after.value !== before.value;
    result.slider = { label: (await slider.locator('.widget-label').first().innerText()).trim(),
                      before: before.value, after: after.value, method };
    // continuous_update=False: the kernel redraws on release. Wait for a different image.
    const changed = await page.waitForFunction(([cell, src]) => {
      const img = cell.querySelector('.widget-output img, .jupyter-widgets-output-area img');
      return img && img.complete && img.naturalWidth > 0 && img.getAttribute('src') !== src;
    }, [await widgetCell.elementHandle(), before.src], { timeout: 90_000, polling: 200 }).then(() => true, () => false);
    result.plot_changed = changed;
    await waitKernelIdle(page, 90_000);
    await page.waitForTimeout(300);
    result.slider.plot_bytes = { before: before.src?.length ?? 0,
                                 after: (await plot.getAttribute('src').catch(() => null))?.length ?? 0 };
  }
  mark('slider');

  // Save (to the test's own copy), so the test can read back what ran.
  await notebook.click({ position: { x: 5, y: 5 } }).catch(() => {});
  await page.keyboard.press('Escape');
  await page.keyboard.press('Control+s');
  await page.waitForFunction(() => !document.querySelector('.lm-TabBar-tab.jp-mod-current.jp-mod-dirty'),
    null, { timeout: 60_000 }).then(() => { result.saved = true; }, () => {});
  mark('saved');
  await screenshots(page, widgetCell);
  mark('screenshots');
} catch (e) {
  result.failure = String(e?.stack ?? e).slice(0, 2000);
  if (page) await page.screenshot({ path: join(opt.out, 'failure.png') }).then(
    () => result.screenshots.push(join(opt.out, 'failure.png')), () => {});
} finally {
  if (browser) await browser.close().catch(() => {});
  result.timings.total = seconds();
  console.log(JSON.stringify(result));
}
process.exit(result.failure ? 1 : 0);

async function menu(page, title, item) {
  // JupyterLab 4 does not expose its command registry to the page: click the menu, as a learner does.
  await page.locator('.lm-MenuBar-item', { hasText: new RegExp(`^${title}$`) }).click();
  await page.locator('.lm-Menu-item:not(.lm-mod-disabled)').filter({
    has: page.locator('.lm-Menu-itemLabel', { hasText: new RegExp(`^${item}$`) }) }).click();
}

async function waitKernelIdle(page, timeout) {
  // the status bar names the kernel once it is started ("No Kernel" before), then its state
  await page.waitForFunction(() => {
    const bar = document.querySelector('#jp-main-statusbar');
    const indicator = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator');
    return bar && /\| Idle/.test(bar.innerText) && !/No Kernel/.test(bar.innerText)
      && indicator && indicator.dataset.status === 'idle';
  }, null, { timeout, polling: 250 });
}

async function screenshots(page, widgetCell) {
  // The notebook scrolls inside the page: make the window as tall as the notebook (up to what
  // Chromium can capture), so that one page screenshot shows every cell.
  // fold the file browser away: room for the cells
  await page.locator('.jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current').click({ timeout: 5_000 }).catch(() => {});
  const scroller = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer');
  for (let i = 0; i < 2; i++) {  // twice: the first resize can reflow the cells
    const height = await scroller.evaluate((el) => el.scrollHeight + el.getBoundingClientRect().top + 40);
    await page.setViewportSize({ width: 1400, height: Math.min(Math.max(3000, Math.ceil(height)), 16000) });
    await page.waitForTimeout(300);
  }
  await scroller.evaluate((el) => { el.scrollTop = 0; });
  await page.waitForTimeout(300);
  const whole = join(opt.out, 'notebook.png');
  await page.screenshot({ path: whole });
  result.screenshots.push(whole);
  if (await widgetCell.count()) {
    const cell = join(opt.out, 'widget_cell.png');
    await widgetCell.screenshot({ path: cell });
    result.screenshots.push(cell);
  }
}
