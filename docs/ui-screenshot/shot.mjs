// Screenshot of llama-server's web UI after one chat turn over a long document.
//
//   node docs/ui-screenshot/shot.mjs            (see README.md in this folder)
//
// Environment (all optional):
//   URL       the llama-server to drive          (default http://127.0.0.1:8080)
//   DOC       text file pasted as the document   (default /tmp/shot/hamlet-act1.txt)
//   QUESTION  the question typed after it         (default "Who is the ghost in this play?")
//   OUT       the PNG written                     (default docs/img/llama-server-ui.png)
//   CHROMIUM  the browser                         (default /usr/bin/chromium)
//   WAIT_S    how long to wait for the answer     (default 300)
//   MAX_TOKENS the UI's "Max tokens" setting       (default 160; decode at depth ~11k runs at a few
//             tokens/s on 2 CPU cores, and an unbounded answer can run to the end of the context)
//   SHOT_DIR  where playwright-core is installed  (default /tmp/shot: npm i playwright-core there)
//
// playwright-core (no browser download) drives Debian's chromium headless. The document is pasted
// with a real paste event, so the UI turns it into a "Pasted" text attachment as it does for any
// paste longer than its pasteLongTextToFileLen setting; the question is typed and sent with Enter.
// The script waits until the streamed /v1/chat/completions response has finished, prints the
// answer and the timings the server reported, and takes the screenshot.
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { execFileSync } from 'node:child_process';
import { createRequire } from 'node:module';

// playwright-core is installed outside the repository (npm i playwright-core in $SHOT_DIR)
const SHOT_DIR = process.env.SHOT_DIR || '/tmp/shot';
const { chromium } = createRequire(path.join(path.resolve(SHOT_DIR), 'package.json'))('playwright-core');

const URL = process.env.URL || 'http://127.0.0.1:8080';
const DOC = process.env.DOC || '/tmp/shot/hamlet-act1.txt';
const QUESTION = process.env.QUESTION || 'Who is the ghost in this play?';
const OUT = process.env.OUT || 'docs/img/llama-server-ui.png';
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const WAIT_MS = 1000 * Number(process.env.WAIT_S || 300);
const MAX_TOKENS = Number(process.env.MAX_TOKENS || 160);

const doc = fs.readFileSync(DOC, 'utf8');
const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'shot-profile-'));
const t0 = Date.now();
const log = (...a) => console.log(`[${((Date.now() - t0) / 1000).toFixed(1)} s]`, ...a);

// a fresh, empty profile (--user-data-dir) for every run
const context = await chromium.launchPersistentContext(profile, {
	executablePath: CHROMIUM,
	headless: true,
	viewport: { width: 1100, height: 800 },
	deviceScaleFactor: 1,
	args: [
		'--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
		'--disable-background-networking', '--disable-component-update', '--disable-sync'
	]
});
let rc = 0;
try {
	const page = context.pages()[0] ?? (await context.newPage());
	page.on('pageerror', (e) => log('page error:', e.message));
	// the UI's settings live in localStorage (LlamaUi.config); set "Max tokens" as a user override
	await page.addInitScript((n) => {
		if (localStorage.getItem('LlamaUi.config') === null) {
			localStorage.setItem('LlamaUi.config', JSON.stringify({ max_tokens: n }));
			localStorage.setItem('LlamaUi.userOverrides', JSON.stringify(['max_tokens']));
		}
	}, MAX_TOKENS);
	await page.goto(URL, { waitUntil: 'networkidle' });
	const input = page.locator('textarea').first();
	await input.waitFor({ state: 'visible', timeout: 30000 });
	await input.click();

	// paste the document (a real ClipboardEvent carrying text/plain)
	await input.evaluate((el, text) => {
		const dt = new DataTransfer();
		dt.setData('text/plain', text);
		el.dispatchEvent(new ClipboardEvent('paste', { clipboardData: dt, bubbles: true, cancelable: true }));
	}, doc);
	log(`pasted ${doc.length} characters from ${DOC}`);
	await page.waitForTimeout(1500);

	await input.click();
	await input.pressSequentially(QUESTION, { delay: 10 });

	const responseP = page.waitForResponse((r) => r.url().includes('/chat/completions') && r.request().method() === 'POST',
		{ timeout: WAIT_MS });
	await input.press('Enter');
	log(`sent: ${QUESTION}`);
	const response = await responseP;
	try {
		const body = response.request().postDataJSON();
		const chars = JSON.stringify(body.messages ?? []).length;
		log(`request: ${body.messages?.length} messages (${chars} characters of JSON), max_tokens ${body.max_tokens}`);
	} catch {}
	log(`response ${response.status()}, streaming`);
	await response.finished();
	log('response finished');

	// the answer, from the SSE body (delta.content pieces) when the browser keeps it
	let answer = '', timings = null;
	try {
		for (const line of (await response.text()).split('\n')) {
			if (!line.startsWith('data: ') || line.includes('[DONE]')) continue;
			const ev = JSON.parse(line.slice(6));
			answer += ev.choices?.[0]?.delta?.content ?? '';
			if (ev.timings) timings = ev.timings;
		}
	} catch (e) {
		log('could not read the response body:', e.message);
	}
	if (answer) console.log('ANSWER:', JSON.stringify(answer));
	if (timings) console.log('TIMINGS:', JSON.stringify(timings));

	await page.waitForTimeout(2000); // let the UI render the final message
	await page.mouse.move(1, 1);
	// scroll the conversation back to its top (the pasted attachment) if the whole answer still
	// shows above the input box; else leave it scrolled to the end
	const scrolled = await page.evaluate(() => {
		const moved = [];
		for (const el of document.querySelectorAll('*')) {
			if (el.scrollHeight > el.clientHeight + 1 && /(auto|scroll)/.test(getComputedStyle(el).overflowY)) {
				moved.push([el, el.scrollTop]);
				el.scrollTop = 0;
			}
		}
		window.__shotMoved = moved;
		return moved.length;
	});
	if (scrolled && answer) {
		await page.waitForTimeout(300);
		const last = answer.trim().split(/\s+/).slice(-4).join(' ');
		const box = await page.getByText(last, { exact: false }).last().boundingBox().catch(() => null);
		const form = await input.boundingBox();
		if (!box || !form || box.y + box.height > form.y - 8) {
			await page.evaluate(() => { for (const [el, top] of window.__shotMoved) el.scrollTop = top; });
			log('conversation taller than the viewport: screenshot of its end');
		}
	}
	await page.waitForTimeout(500);
	fs.mkdirSync(path.dirname(OUT), { recursive: true });
	await page.screenshot({ path: OUT });
	// smaller PNG with pngquant (Debian package pngquant) when it is installed
	try {
		execFileSync('pngquant', ['--force', '--skip-if-larger', '--quality=70-95', '--output', OUT, OUT]);
	} catch (e) {
		if (e.code !== 'ENOENT' && e.status !== 98 && e.status !== 99) log('pngquant failed:', e.message);
	}
	log(`wrote ${OUT} (${fs.statSync(OUT).size} bytes)`);
} catch (e) {
	console.error('shot: error:', e);
	rc = 1;
} finally {
	await context.close();
	fs.rmSync(profile, { recursive: true, force: true });
}
process.exit(rc);
