// Drives the console's Inbox page in headless Chromium (playwright-core):
// log in as an operator → the quarantined event is listed → release it →
// it is accepted (flagged as after a gap) and no longer quarantined.
// Saves a screenshot.
//
// Usage: node inbox.cjs ADMIN_URL OPERATOR_KEY EVENT_ID SCREENSHOT_PATH
// Needs playwright-core on NODE_PATH and Chromium at $CHROMIUM (default /usr/bin/chromium).
const { chromium } = require('playwright-core');

const [adminUrl, key, eventId, screenshot] = process.argv.slice(2);

function fail(msg) {
  console.error(`console inbox: ${msg}`);
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

    // The list: every event, then the quarantined ones.
    await page.goto(`${adminUrl}/console/inbox`);
    const all = page.locator('tr', { hasText: eventId });
    if ((await all.count()) !== 1) fail(`${eventId} is not listed once`);
    await page.click('a[href="/console/inbox?state=quarantined"]');
    await page.waitForURL(`${adminUrl}/console/inbox?state=quarantined`);
    const h1 = (await page.textContent('h1')).trim();
    if (h1 !== 'Inbox: quarantined') fail(`unexpected heading ${h1}`);
    const row = page.locator('tr', { hasText: eventId });
    if ((await row.count()) !== 1) fail(`the quarantined ${eventId} is not listed`);
    const state = (await row.locator('td.state').textContent()).trim();
    if (state !== 'quarantined') fail(`${eventId} is ${state}`);

    // Release it.
    await Promise.all([page.waitForURL(/\/decide$/), row.locator('button[value=release]').click()]);
    const result = (await page.textContent('p.card')).trim();
    if (!result.includes(`release: ${eventId}`)) fail(`unexpected result: ${result}`);
    const released = page.locator('tr', { hasText: eventId });
    const now = (await released.locator('td.state').textContent()).trim();
    if (now !== 'accepted (gap)') fail(`after the release ${eventId} is ${now}`);
    if ((await released.locator('button[value=release]').count()) !== 0) fail('still offered for release');
    await page.screenshot({ path: screenshot, fullPage: true });

    await page.goto(`${adminUrl}/console/inbox?state=quarantined`);
    if ((await page.locator('tr', { hasText: eventId }).count()) !== 0) fail(`${eventId} is still quarantined`);
    console.log(`console inbox: ok (${screenshot})`);
  } finally {
    clearTimeout(timer);
    await browser.close();
  }
})().catch((e) => fail(e.stack || String(e)));
