// Builds amount_threshold_js.wasm, a component of the effectgate:policy
// world (../../../wit), from policy.js with componentize-js.
//
//   npm install && npm run build            # componentize-js from ./node_modules
//   node build.mjs [OUT.wasm]               # the same; OUT defaults to ./amount_threshold_js.wasm
//
// COMPONENTIZE_JS_PREFIX=DIR uses componentize-js installed with
// `npm install --prefix DIR @bytecodealliance/componentize-js` instead.
//
// Every optional WASI feature of the JavaScript engine is disabled
// (stdio, random, clocks, http): a policy has no network, and the world's
// own `clock` interface gives the time. The imports left are stubbed by
// componentize-js, so the component imports only the policy world.

import { writeFile } from "node:fs/promises";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = resolve(process.argv[2] ?? join(here, "amount_threshold_js.wasm"));

async function loadComponentize() {
  const prefix = process.env.COMPONENTIZE_JS_PREFIX;
  if (prefix) {
    const entry = join(
      prefix,
      "node_modules/@bytecodealliance/componentize-js/src/componentize.js",
    );
    return import(pathToFileURL(entry).href);
  }
  return import("@bytecodealliance/componentize-js");
}

const { componentize } = await loadComponentize();
const { component } = await componentize({
  sourcePath: join(here, "policy.js"),
  witPath: join(here, "../../../wit"),
  worldName: "policy",
  disableFeatures: ["stdio", "random", "clocks", "http", "fetch-event"],
});
await writeFile(out, component);
console.log(`${out}: ${(component.byteLength / (1 << 20)).toFixed(1)} MiB`);
