// MXNet's KVStore tutorial (as examples/tutorial_dist.py) against a tensorkv server, from
// Node: `npm ci`, then `TENSORKV_SERVERS=127.0.0.1:50051 node tutorial.js` with a server
// started by `tensorkv-server --num-workers 1`. It prints the values MXNet's tutorial
// prints; as in tutorial_dist.py, the updater runs on the server as
// SGD(learning_rate=-2), so MXNet's "update on key" lines are not printed.
'use strict';

const { Client, ndarray } = require('./tensorkv');

/** An array as NumPy prints a 2-D float32 array of whole numbers: [[2. 2. 2.]\n [2. 2. 2.]]. */
function show(array) {
  const [rows, cols] = array.shape;
  const cells = Array.from(array.data, (v) => (Number.isInteger(v) ? `${v}.` : String(v)));
  const width = Math.max(...cells.map((cell) => cell.length));
  const lines = [];
  for (let r = 0; r < rows; r += 1) {
    lines.push(`[${cells.slice(r * cols, (r + 1) * cols).map((cell) => cell.padStart(width)).join(' ')}]`);
  }
  console.log(`[${lines.join('\n ')}]`);
}

/** The sum of one array per device, which the client pushes as one value (as MXNet does). */
function sum(arrays) {
  const total = ndarray(arrays[0].shape, 0);
  for (const array of arrays) array.data.forEach((value, i) => { total.data[i] += value; });
  return total;
}

async function pullOne(kv, key) {
  const [[, value]] = await kv.pull([key]);
  return value;
}

async function main() {
  const [address] = (process.env.TENSORKV_SERVERS || '').split(',');
  if (!address) throw new Error('set TENSORKV_SERVERS=host:port');
  const kv = new Client(address);
  await kv.register();
  const shape = [2, 3];
  const devices = 4;

  // Initialization
  await kv.init([[3, ndarray(shape, 2)]]);
  show(await pullOne(kv, 3));

  // Push, Aggregate, and Update
  await kv.push([[3, ndarray(shape, 8)]]);
  show(await pullOne(kv, 3));

  await kv.push([[3, sum(Array.from({ length: devices }, () => ndarray(shape, 1)))]]);
  show(await pullOne(kv, 3));

  // The tutorial's updater, stored += input * 2, as an optimizer that runs on the server.
  await kv.setOptimizer('sgd', { learning_rate: -2.0 });
  show(await pullOne(kv, 3));

  await kv.push([[3, ndarray(shape, 1)]]);
  show(await pullOne(kv, 3));

  // Pull: every device gets the same value; the tutorial prints the second.
  show(await pullOne(kv, 3));

  // Handle a List of Key-Value Pairs: a single device
  const keys = [5, 7, 9];
  await kv.init(keys.map((key) => [key, ndarray(shape, 1)]));
  await kv.push(keys.map((key) => [key, ndarray(shape, 1)]));
  show((await kv.pull(keys))[1][1]);

  // Multiple devices
  await kv.push(keys.map((key) => [key, sum(Array.from({ length: devices }, () => ndarray(shape, 1)))]));
  show((await kv.pull(keys))[1][1]);
  await kv.close();
}

main().catch((error) => {
  console.error(`${error.name}: ${error.message}`);
  process.exit(1);
});
