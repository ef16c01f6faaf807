// A minimal tensorkv client, written from protos/ alone (docs/protocol.md walks through it).
//
// One server, float32 values, the plain RPCs (Register, Init, Push, Pull, SetUpdater,
// Unregister). It skips what docs/protocol.md lists as optional: the Session stream,
// shared memory, the data channel, several servers.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTOS = path.resolve(__dirname, '..', '..', 'protos');
// Bytes of tensor data per message; a larger value continues in TensorFrame.more.
const CHUNK_BYTES = Number(process.env.TENSORKV_CHUNK_BYTES || 1 << 20);
const FLOAT32 = 'DTYPE_FLOAT32';

const definition = protoLoader.loadSync('tensorkv/v1/kvstore.proto', {
  includeDirs: [PROTOS],
  keepCase: true, // field names as in the proto: int_key, num_workers
  longs: String, // int64 and uint64 (keys, incarnation) as decimal strings, exact
  enums: String,
  defaults: true,
  oneofs: true,
});
const { KVStoreService } = grpc.loadPackageDefinition(definition).tensorkv.v1;

/** A KVStoreError as the server named it: code (gRPC), errorClass (tensorkv-error), message. */
class KVStoreError extends Error {
  constructor(rpcError) {
    const [errorClass] = rpcError.metadata ? rpcError.metadata.get('tensorkv-error') : [];
    super(rpcError.details || rpcError.message);
    this.name = errorClass ? String(errorClass) : 'KVStoreError';
    this.code = rpcError.code;
  }
}

/** A float32 array of `shape`: {shape, data: Float32Array}. */
function ndarray(shape, fill) {
  return { shape, data: new Float32Array(shape.reduce((a, b) => a * b, 1)).fill(fill) };
}

function encodeKey(key) {
  return typeof key === 'number' ? { int_key: key } : { str_key: key };
}

function decodeKey(key) {
  return key.kind === 'int_key' ? Number(key.int_key) : key.str_key;
}

function toBytes(array) {
  const bytes = Buffer.alloc(array.data.length * 4);
  array.data.forEach((value, i) => bytes.writeFloatLE(value, i * 4));
  return bytes;
}

function fromBytes(shape, bytes) {
  const data = new Float32Array(bytes.length / 4);
  data.forEach((_, i) => { data[i] = bytes.readFloatLE(i * 4); });
  return { shape, data };
}

/** The TensorFrames of `values` [[key, ndarray]]: whole tensors while they fit in
 * CHUNK_BYTES; a larger one ends its frame with its first bytes, and frames of `more`
 * carry the rest. */
function* frames(values) {
  let entries = [];
  let size = 0;
  for (const [key, array] of values) {
    const bytes = toBytes(array);
    const room = Math.max(CHUNK_BYTES - size, 0);
    const entry = (data) => ({ key: encodeKey(key), tensor: { dtype: FLOAT32, shape: array.shape, data } });
    if (bytes.length <= room) {
      entries.push(entry(bytes));
      size += bytes.length;
      continue;
    }
    entries.push(entry(bytes.subarray(0, room)));
    yield { entries };
    for (let at = room; at < bytes.length; at += CHUNK_BYTES) {
      yield { entries: [], more: bytes.subarray(at, at + CHUNK_BYTES) };
    }
    entries = [];
    size = 0;
  }
  if (entries.length > 0) yield { entries };
}

/** Reassembles the values of a stream of TensorFrames: feed() each frame, then values(). */
class FrameReader {
  constructor() {
    this.done = []; // [key, ndarray]
    this.pending = null; // the incomplete last entry: {key, shape, parts, missing}
  }

  feed(frame) {
    if (frame.more.length > 0) {
      if (!this.pending) throw new Error('TensorFrame.more without an incomplete entry');
      this.add(frame.more);
    }
    for (const entry of frame.entries) {
      if (this.pending) throw new Error('a new entry before the last one was complete');
      if (entry.tensor.dtype !== FLOAT32) throw new Error(`this client reads float32 only, not ${entry.tensor.dtype}`);
      const shape = entry.tensor.shape.map(Number);
      const count = entry.slice ? Number(entry.slice.end) - Number(entry.slice.begin) : shape.reduce((a, b) => a * b, 1);
      this.pending = { key: decodeKey(entry.key), shape, parts: [], missing: count * 4 };
      this.add(entry.tensor.data);
    }
  }

  add(bytes) {
    const entry = this.pending;
    entry.parts.push(bytes);
    entry.missing -= bytes.length;
    if (entry.missing < 0) throw new Error(`key ${entry.key}: more bytes than its shape holds`);
    if (entry.missing === 0) {
      this.done.push([entry.key, fromBytes(entry.shape, Buffer.concat(entry.parts))]);
      this.pending = null;
    }
  }

  values() {
    if (this.pending) throw new Error(`key ${this.pending.key}: the stream ended inside its value`);
    return this.done;
  }
}

/** A worker of one tensorkv server at `address` ('host:port'). */
class Client {
  constructor(address) {
    this.stub = new KVStoreService(address, grpc.credentials.createInsecure());
    this.rank = null;
    this.incarnation = undefined;
  }

  /** Register with the server: the rank it gives, and the incarnation that every call
   * carrying the rank sends back. */
  async register() {
    const reply = await this.unary('Register', {});
    this.rank = reply.rank;
    this.incarnation = reply.incarnation; // undefined on servers that do not send one
    if (reply.lease_ttl_ms) {
      // The rank is a lease: renewed every third of it while the client is open. A lost
      // lease shows as the next call's FAILED_PRECONDITION.
      this.heartbeat = setInterval(() => this.unary('KeepAlive', this.who()).catch(() => {}), reply.lease_ttl_ms / 3);
      this.heartbeat.unref();
    }
    return reply;
  }

  /** The caller's identity, in every request that carries a rank. */
  who() {
    return { rank: this.rank, incarnation: this.incarnation };
  }

  init(values) {
    return this.clientStream('Init', values, { wait_only: false });
  }

  push(values) {
    return this.clientStream('Push', values, {});
  }

  /** The values of `keys`, as [[key, ndarray]]. */
  pull(keys) {
    const reader = new FrameReader();
    const call = this.stub.Pull({ ...this.who(), keys: keys.map(encodeKey) });
    return new Promise((resolve, reject) => {
      call.on('data', (response) => {
        try {
          reader.feed(response.frame);
        } catch (error) {
          call.cancel();
          reject(error);
        }
      });
      call.on('error', (error) => reject(new KVStoreError(error)));
      call.on('end', () => {
        try {
          resolve(reader.values());
        } catch (error) {
          reject(error);
        }
      });
    });
  }

  /** Install the optimizer `name` with `params` {hyper-parameter: number} on the server. */
  setOptimizer(name, params) {
    return this.stream('SetUpdater', [{ optimizer: { name, params } }]);
  }

  async close() {
    clearInterval(this.heartbeat);
    if (this.rank !== null) await this.unary('Unregister', this.who());
    this.stub.close();
  }

  unary(method, request) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, (error, reply) => (error ? reject(new KVStoreError(error)) : resolve(reply)));
    });
  }

  /** A client-streaming call of `values`: the first message carries who() and `fields`. */
  clientStream(method, values, fields) {
    const messages = [...frames(values)].map((frame) => ({ frame }));
    if (messages.length === 0) messages.push({ frame: { entries: [] } });
    Object.assign(messages[0], this.who(), fields);
    return this.stream(method, messages);
  }

  stream(method, messages) {
    return new Promise((resolve, reject) => {
      const call = this.stub[method]((error, reply) => (error ? reject(new KVStoreError(error)) : resolve(reply)));
      for (const message of messages) call.write(message);
      call.end();
    });
  }
}

module.exports = { Client, KVStoreError, ndarray };
