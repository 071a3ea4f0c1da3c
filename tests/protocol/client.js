// A q6serve client written from proto/q6serve/v1/q6serve.proto alone (plus the standard health
// and reflection protos), the way a host author in another language would: it encodes tensors
// itself (little-endian f32/f16/bf16, row-major), computes upload sha256s, reads StreamError
// codes as numeric gRPC status codes and raises the receive limit as the .proto tells it to.
//
// Usage: node client.js SPEC.json   (written by test_node_client.py, which checks the results)
// Prints JSON lines: {"event": "results", ...} with every outcome, then {"event": "watching"}
// once a health Watch saw SERVING; the test then drains the worker and the last line is
// {"event": "watch", "statuses": [...]} with the statuses Watch saw until NOT_SERVING.
'use strict';

const crypto = require('crypto');
const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const ROOT = path.resolve(__dirname, '..', '..');
const LOADER = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true };
const MIB = 1 << 20;

function load(file, includeDirs) {
  return grpc.loadPackageDefinition(protoLoader.loadSync(file, { ...LOADER, includeDirs }));
}

const q6 = load('q6serve/v1/q6serve.proto', [path.join(ROOT, 'proto')]).q6serve.v1;
const std = [path.join(__dirname, 'protos')];
const healthPkg = load('grpc/health/v1/health.proto', std).grpc.health.v1;
const reflPkg = load('grpc/reflection/v1/reflection.proto', std).grpc.reflection.v1;

// -- tensor encoding (the .proto's byte layout) ---------------------------------------------
const SIZE = { DTYPE_F32: 4, DTYPE_F16: 2, DTYPE_BF16: 2 };
const f32buf = new Float32Array(1);
const u32buf = new Uint32Array(f32buf.buffer);

function f32Bits(v) { f32buf[0] = v; return u32buf[0]; }
function bitsF32(b) { u32buf[0] = b >>> 0; return f32buf[0]; }

function toF16(v) {  // IEEE binary16, round to nearest even
  const b = f32Bits(v);
  const sign = (b >>> 16) & 0x8000;
  const exp = (b >>> 23) & 0xff;
  let mant = b & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  let e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e;
    let h = mant >>> shift;
    const rem = mant & ((1 << shift) - 1);
    const half = 1 << (shift - 1);
    if (rem > half || (rem === half && (h & 1))) h += 1;
    return sign | h;
  }
  let h = (e << 10) | (mant >>> 13);
  const rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem === 0x1000 && (h & 1))) h += 1;
  return sign | h;
}

function fromF16(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const e = (h >>> 10) & 0x1f;
  const m = h & 0x3ff;
  if (e === 0) return sign * m * 2 ** -24;
  if (e === 0x1f) return m ? NaN : sign * Infinity;
  return sign * (1 + m / 1024) * 2 ** (e - 15);
}

function toBF16(v) {  // the high half of the binary32 bits, round to nearest even
  const b = f32Bits(v);
  return ((b + 0x7fff + ((b >>> 16) & 1)) >>> 16) & 0xffff;
}

function encode(values, shape, dtype) {
  const buf = Buffer.alloc(values.length * SIZE[dtype]);
  values.forEach((v, i) => {
    if (dtype === 'DTYPE_F32') buf.writeFloatLE(v, 4 * i);
    else if (dtype === 'DTYPE_F16') buf.writeUInt16LE(toF16(v), 2 * i);
    else buf.writeUInt16LE(toBF16(v), 2 * i);
  });
  return { dtype, shape, data: buf };
}

function decode(t) {
  const n = t.shape.reduce((a, b) => a * Number(b), 1);
  if (t.data.length !== n * SIZE[t.dtype]) throw new Error(`bad tensor byte count ${t.data.length}`);
  const out = new Array(n);
  for (let i = 0; i < n; i++) {
    if (t.dtype === 'DTYPE_F32') out[i] = t.data.readFloatLE(4 * i);
    else if (t.dtype === 'DTYPE_F16') out[i] = fromF16(t.data.readUInt16LE(2 * i));
    else out[i] = bitsF32(t.data.readUInt16LE(2 * i) << 16);
  }
  return { shape: t.shape.map(Number), dtype: t.dtype, values: out };
}

// -- call helpers ---------------------------------------------------------------------------
const unary = (client, method, req, opts = {}) => new Promise((resolve) => {
  const deadline = new Date(Date.now() + 30000);
  client[method](req, { deadline, ...opts }, (err, res) => resolve(err ? { code: err.code, details: err.details } : { code: 0, res }));
});

function upload(client, header, payload, chunk = 64 * 1024) {
  return new Promise((resolve) => {
    const call = client.UploadWeight({ deadline: new Date(Date.now() + 30000) }, (err, res) =>
      resolve(err ? { code: err.code, details: err.details } : { code: 0, res }));
    call.write({ header });
    for (let i = 0; i < payload.length; i += chunk) call.write({ chunk: payload.subarray(i, i + chunk) });
    call.end();
  });
}

const sha256 = (buf) => crypto.createHash('sha256').update(buf).digest('hex');

function matmulStream(client, requests) {
  return new Promise((resolve, reject) => {
    const replies = {};
    const call = client.MatmulStream({ deadline: new Date(Date.now() + 30000) });
    call.on('data', (r) => {
      replies[r.request_id] = r.outcome === 'error'
        ? { code: r.error.code, message: r.error.message }
        : { code: 0, y: decode(r.result.y), precision: r.result.precision, request_id: r.result.request_id };
    });
    call.on('error', reject);
    call.on('end', () => resolve(replies));
    requests.forEach((r) => call.write(r));
    call.end();
  });
}

function reflect(target, requests) {  // one ServerReflectionInfo stream, replies in order
  return new Promise((resolve, reject) => {
    const client = new reflPkg.ServerReflection(target, grpc.credentials.createInsecure());
    const out = [];
    const call = client.ServerReflectionInfo({ deadline: new Date(Date.now() + 30000) });
    call.on('data', (r) => out.push(r));
    call.on('error', reject);
    call.on('end', () => { client.close(); resolve(out); });
    requests.forEach((r) => call.write(r));
    call.end();
  });
}

// A FileDescriptorSet (field 1: repeated FileDescriptorProto) from reflection's bytes, so
// proto-loader can build a client from what the worker describes, as grpcurl does.
function descriptorSet(protos) {
  const parts = [];
  for (const p of protos) {
    const len = [];
    let n = p.length;
    do { len.push((n & 0x7f) | (n > 0x7f ? 0x80 : 0)); n >>>= 7; } while (n);
    parts.push(Buffer.from([0x0a, ...len]), p);
  }
  return Buffer.concat(parts);
}

// -- the run --------------------------------------------------------------------------------
async function main() {
  const spec = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
  const target = spec.target;
  const creds = grpc.credentials.createInsecure();
  // The .proto: replies can exceed the 4 MiB default receive limit of grpc-js.
  const limits = { 'grpc.max_receive_message_length': 64 * MIB, 'grpc.max_send_message_length': 64 * MIB };
  const c = new q6.Q6Serve(target, creds, limits);
  const small = new q6.Q6Serve(target, creds);  // grpc-js defaults
  const health = new healthPkg.Health(target, creds);
  const R = {};

  // health
  R.health_check = {};
  for (const service of ['', 'q6serve.v1.Q6Serve', 'no.such.Service']) {
    const r = await unary(health, 'Check', { service });
    R.health_check[service] = r.code ? { code: r.code } : { code: 0, status: r.res.status };
  }
  R.health_list = await unary(health, 'List', {});

  // reflection v1: list, file by name, symbols (service, message, method), unknown symbol
  const refl = await reflect(target, [
    { list_services: '' },
    { file_by_filename: 'q6serve/v1/q6serve.proto' },
    { file_containing_symbol: 'q6serve.v1.Q6Serve' },
    { file_containing_symbol: 'q6serve.v1.MatmulRequest' },
    { file_containing_symbol: 'q6serve.v1.Q6Serve.Matmul' },
    { file_containing_symbol: 'grpc.reflection.v1.ServerReflection' },
    { file_containing_symbol: 'q6serve.v1.NoSuchThing' },
  ]);
  R.reflection = {
    services: refl[0].list_services_response.service.map((s) => s.name).sort(),
    lookups: refl.slice(1).map((r) => (r.message_response === 'error_response'
      ? { error_code: r.error_response.error_code }
      : { files: r.file_descriptor_response.file_descriptor_proto.length })),
  };
  // A client built from the method lookup's descriptors alone answers GetStatus.
  const described = grpc.loadPackageDefinition(protoLoader.loadFileDescriptorSetFromBuffer(
    descriptorSet(refl[4].file_descriptor_response.file_descriptor_proto), LOADER));
  const Reflected = described.q6serve.v1.Q6Serve;
  R.reflected_methods = Object.keys(Reflected.service).sort();
  const viaReflection = await unary(new Reflected(target, creds), 'GetStatus', {});
  R.reflected_status = { code: viaReflection.code, backend: viaReflection.res && viaReflection.res.backend };

  R.status = (await unary(c, 'GetStatus', {})).res;

  // uploads: Q6_K bytes as given, f32 rows encoded here; a wrong sha256 is refused
  const q6kBytes = Buffer.from(spec.q6k.data_b64, 'base64');
  const q6kHeader = { name: spec.q6k.name, rows: spec.q6k.rows, k: spec.q6k.k, format: 'UPLOAD_FORMAT_Q6_K',
    total_bytes: q6kBytes.length, sha256: sha256(q6kBytes) };
  R.upload_q6k = await upload(c, q6kHeader, q6kBytes);
  const f32Bytes = encode(spec.f32w.values, [spec.f32w.rows, spec.f32w.k], 'DTYPE_F32').data;
  R.upload_f32 = await upload(c, { name: spec.f32w.name, rows: spec.f32w.rows, k: spec.f32w.k,
    format: 'UPLOAD_FORMAT_F32', total_bytes: f32Bytes.length, sha256: sha256(f32Bytes) }, f32Bytes);
  R.upload_bad_sha = await upload(c, { ...q6kHeader, name: 'bad-sha', sha256: 'ab'.repeat(32) }, q6kBytes);
  R.upload_dup = await upload(c, q6kHeader, q6kBytes);

  R.load = await unary(c, 'LoadWeights', { gguf_path: spec.gguf.path, tensors: [spec.gguf.tensor], prefix: spec.gguf.prefix });
  R.list = (await unary(c, 'ListWeights', {})).res.weights.map((w) => w.name).sort();
  R.get = (await unary(c, 'GetWeight', { name: spec.q6k.name })).res.weight;
  R.get_missing = await unary(c, 'GetWeight', { name: 'missing' });

  // matmuls: every weight, x in f32/f16/bf16, y in f32, plus f16 and bf16 outputs
  const { n, k, values } = spec.x;
  R.matmul = {};
  for (const weight of [spec.q6k.name, spec.f32w.name, spec.gguf.prefix + spec.gguf.tensor]) {
    for (const [xd, yd] of [['DTYPE_F32', 'DTYPE_F32'], ['DTYPE_F16', 'DTYPE_F32'], ['DTYPE_BF16', 'DTYPE_F32'],
      ['DTYPE_F32', 'DTYPE_F16'], ['DTYPE_F32', 'DTYPE_BF16']]) {
      const r = await unary(c, 'Matmul', { weight, x: encode(values, [n, k], xd), out_dtype: yd,
        precision: 'PRECISION_EXACT', request_id: `${weight}/${xd}/${yd}` });
      R.matmul[`${weight}/${xd}/${yd}`] = r.code ? { code: r.code, details: r.details }
        : { y: decode(r.res.y), request_id: r.res.request_id, precision: r.res.precision };
    }
  }
  R.matmul_missing = await unary(c, 'Matmul', { weight: 'missing', x: encode(values, [n, k], 'DTYPE_F32') });

  // a stream with bad requests mixed in: each gets its own reply, the stream goes on
  const x32 = encode(values, [n, k], 'DTYPE_F32');
  const tooMany = new Array((spec.max_request_rows + 1) * k).fill(0);
  R.stream = await matmulStream(c, [
    { request_id: 'ok-f32', weight: spec.q6k.name, x: x32, precision: 'PRECISION_EXACT' },
    { request_id: 'no-weight', weight: 'missing', x: x32 },
    { request_id: 'wrong-k', weight: spec.q6k.name, x: encode(values.slice(0, n * 256), [n, 256], 'DTYPE_F32') },
    { request_id: 'too-many-rows', weight: spec.q6k.name,
      x: encode(tooMany, [spec.max_request_rows + 1, k], 'DTYPE_F32') },
    { request_id: 'short-bytes', weight: spec.q6k.name, x: { ...x32, data: x32.data.subarray(4) } },
    { request_id: 'no-x', weight: spec.q6k.name },
    { request_id: 'ok-bf16', weight: spec.q6k.name, x: encode(values, [n, k], 'DTYPE_BF16'), precision: 'PRECISION_EXACT' },
  ]);

  // shared-memory regions (/dev/shm/<key> is the POSIX object shm_open names): x read from one,
  // y written into it, then an out-of-bounds reference refused
  const key = `q6serve-node-${process.pid}`;
  const shmPath = path.join('/dev/shm', key);
  const xBytes = x32.data.length;
  const yBytes = n * spec.q6k.rows * 4;
  fs.writeFileSync(shmPath, Buffer.concat([x32.data, Buffer.alloc(yBytes, 0xff)]));
  try {
    R.region_register = await unary(c, 'RegisterRegion', { name: 'node-r',
      system: { key, offset: 0, byte_size: xBytes + yBytes } });
    R.region_list = (await unary(c, 'ListRegions', {})).res.regions.map((r) => r.name);
    const viaRegion = await unary(c, 'Matmul', { weight: spec.q6k.name, precision: 'PRECISION_EXACT',
      x: { dtype: 'DTYPE_F32', shape: [n, k], data: Buffer.alloc(0) },
      x_region: { region: 'node-r', offset: 0 }, y_region: { region: 'node-r', offset: xBytes } });
    R.region_matmul = viaRegion.code ? viaRegion : { code: 0, reply_bytes: viaRegion.res.y.data.length,
      y: decode({ ...viaRegion.res.y, data: fs.readFileSync(shmPath).subarray(xBytes) }) };
    R.region_out_of_bounds = await unary(c, 'Matmul', { weight: spec.q6k.name,
      x: { dtype: 'DTYPE_F32', shape: [n, k], data: Buffer.alloc(0) },
      x_region: { region: 'node-r', offset: yBytes + 4 } });
    R.region_unregister = (await unary(c, 'UnregisterRegion', { name: 'node-r' })).code;
  } finally {
    fs.unlinkSync(shmPath);
  }

  // flags
  R.flags_off = (await unary(c, 'SetFlags', { flags: [{ name: 'Q6SERVE_DYNAMIC_BATCHING', enabled: false }] })).res.flags;
  R.flags_on = (await unary(c, 'SetFlags', { flags: [{ name: 'Q6SERVE_DYNAMIC_BATCHING', enabled: true }] })).res.flags;

  // a reply over 4 MiB: refused by default limits, received with the limit raised
  const big = Buffer.from(spec.big.data_b64, 'base64');
  R.upload_big = await upload(c, { name: spec.big.name, rows: spec.big.rows, k: spec.big.k,
    format: 'UPLOAD_FORMAT_Q6_K', total_bytes: big.length, sha256: sha256(big) }, big);
  const bigX = encode(new Array(spec.big.n * spec.big.k).fill(0).map((_, i) => ((i % 7) - 3) / 4),
    [spec.big.n, spec.big.k], 'DTYPE_F32');
  const bigReq = { weight: spec.big.name, x: bigX, precision: 'PRECISION_EXACT' };
  R.big_default_limit = await unary(small, 'Matmul', bigReq);
  const bigOk = await unary(c, 'Matmul', bigReq);
  if (bigOk.code) R.big_raised_limit = bigOk;
  else {
    const y = decode(bigOk.res.y);
    R.big_raised_limit = { code: 0, shape: y.shape, bytes: bigOk.res.y.data.length,
      sum: y.values.reduce((a, b) => a + b, 0), first: y.values.slice(0, 8) };
  }

  // unload everything
  R.unload = [];
  for (const name of R.list.concat([spec.big.name])) R.unload.push((await unary(c, 'UnloadWeight', { name })).code);
  R.list_after = (await unary(c, 'ListWeights', {})).res.weights.length;
  console.log(JSON.stringify({ event: 'results', ...R }));

  // health Watch: SERVING now; NOT_SERVING once the test drains the worker
  const statuses = [];
  await new Promise((resolve, reject) => {
    const call = health.Watch({ service: 'q6serve.v1.Q6Serve' });
    call.on('data', (r) => {
      statuses.push(r.status);
      if (r.status === 'SERVING' && statuses.length === 1) console.log(JSON.stringify({ event: 'watching' }));
      if (r.status === 'NOT_SERVING') { call.cancel(); resolve(); }
    });
    call.on('error', (e) => (e.code === grpc.status.CANCELLED ? resolve() : reject(e)));
  });
  console.log(JSON.stringify({ event: 'watch', statuses }));
  for (const x of [c, small, health]) x.close();
}

main().catch((e) => { console.error(e && e.stack ? e.stack : e); process.exit(1); });
