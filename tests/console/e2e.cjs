// Drives the operator console in headless Chromium (playwright-core):
// log in → see the pending approval → approve → the operation executes →
// the timeline shows it. Saves a screenshot.
//
// Usage: node e2e.cjs ADMIN_URL APPROVER_KEY OPERATION_ID SCREENSHOT_PATH
// Needs playwright-core on NODE_PATH and Chromium at $CHROMIUM (default /usr/bin/chromium).
const { chromium } = require('playwright-core');

const [adminUrl, key, operationId, screenshot] = process.argv.slice(2);

function fail(msg) {
  console.error(`console e2e: ${msg}`);
  process.exit(1);
}

(async () => {
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
           '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
  const timer = setTimeout(() => fail('timed out after 60 s'), 60000);
  try {
    const page = await browser.newPage();
    await page.goto(`${adminUrl}/console`);
    if (!page.url().endsWith('/console/login')) fail(`expected the login page, got ${page.url()}`);
    await page.fill('#key', key);
    await Promise.all([page.waitForURL(`${adminUrl}/console`), page.click('#login')]);
    const pending = (await page.textContent('#pending')).trim();
    if (pending !== '1') fail(`expected 1 pending approval, got ${pending}`);

    // The count leads to the list.
    await Promise.all([page.waitForURL(`${adminUrl}/console/approvals`), page.click('#pending a')]);
    const card = page.locator('.approval', { hasText: operationId });
    if ((await card.count()) !== 1) fail(`the approval for ${operationId} is not listed`);
    const body = await card.locator('pre.body').textContent();
    if (!body.includes('"amount": 5000')) fail(`the exact request body is not shown: ${body}`);
    if ((await card.locator('input[name=body], textarea').count()) !== 0) fail('the console must not offer to edit the request');
    await card.locator('input[name=comment]').fill('checked in the browser');
    await Promise.all([page.waitForURL(/\/console\/operations\//), card.locator('button.approve').click()]);

    // The route executes approved requests itself; the timeline shows it.
    let state = '';
    for (let i = 0; i < 100; i++) {
      state = (await page.textContent('#state')).trim();
      if (state === 'COMPLETED') break;
      await page.waitForTimeout(100);
      await page.reload();
    }
    if (state !== 'COMPLETED') fail(`the operation did not complete: ${state}`);
    const timeline = await page.textContent('#timeline');
    for (const needle of ['AWAITING_APPROVAL → AWAITING_APPROVAL', 'checked in the browser', 'EXECUTING → COMPLETED']) {
      if (!timeline.includes(needle)) fail(`timeline lacks "${needle}": ${timeline}`);
    }
    // Times read as ISO 8601 in UTC with a relative hint, not epoch ms.
    if (!/\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z \((now|\d+ s ago)\)/.test(timeline)) {
      fail(`timeline times are not readable: ${timeline}`);
    }
    await page.screenshot({ path: screenshot, fullPage: true });
    console.log(`console e2e: ok (${screenshot})`);
  } finally {
    clearTimeout(timer);
    await browser.close();
  }
})().catch((e) => fail(e.stack || String(e)));
