// Quantized checkpoints and the converter, against mlx-lm 0.32.2 (GitHub
// issue 4). Sources are generated f32 checkpoints; every quantized
// checkpoint exists twice, made by mlx-lm's converter and by ours, and both
// runtimes run both. All conversions and all reference runs happen once, in
// one setup (one Python process for mlx-lm's conversions, one for its greedy
// runs), which keeps the file to about a minute on two cores.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { spawnSync } = require('node:child_process');
const { addon, fixture, reference, maxAbsDiff, root } = require('./helpers.cjs');

const GEN = 64;
const CHUNK = 16;
const prompts = {
  one: [1],
  few: [1, 40, 300, 41, 7, 512, 99],
  // Longer than the prefill chunk our models are loaded with.
  long: Array.from({ length: 45 }, (_, i) => (i * 37 + 11) % 900 + 2),
};
const promptNames = Object.keys(prompts);

const SOURCES = {
  dense: ['tiny-f32-hf', { preset: 'tiny', dtype: 'f32', layout: 'hf' }],
  moe: ['tiny-moe-f32-hf', { preset: 'tiny-moe', dtype: 'f32', layout: 'hf' }],
  moeMlx: ['tiny-moe-f32-mlx', { preset: 'tiny-moe', dtype: 'f32', layout: 'mlx' }],
};

// Affine 4-bit uses group 32 so that every projection of the tiny MoE is
// quantized (its experts' down_proj is 32 wide); affine 8-bit keeps mlx-lm's
// default group 64, which leaves those down_proj unquantized (mlx-lm's
// divisibility rule): a mixed dense/quantized expert block.
//
// Logit tolerances (max-abs over the 1024 first-step logits, whose spread is
// about 8). MEASURED on the CPU backend: our logits equal mlx-lm's exactly
// (difference 0) in every mode, for checkpoints from either converter, on
// both decode paths (compiled, eager) and every MoE prefill route (direct
// gathered, sorted, host-grouped via MLX_LFM_MOE_PREFILL=grouped): the
// quantized matmuls are the same libmlx kernels fed the same packed weights,
// and our graph matches mlx-lm's op for op. So on CPU we assert exact
// equality; any difference there means the graphs differ.
// A GPU build runs our kernels on the GPU against mlx-lm's CPU wheel. That
// was NOT measured here (no GPU build in this environment); the per-mode
// bounds below are reasoned from how each mode dequantizes:
// - mxfp4 / mxfp8 / nvfp4: dequantized weights are exact in f32 (an fp4/fp8
//   code times a power-of-two or e4m3 scale needs at most 8 mantissa bits),
//   so a kernel is free only in its f32 summation order: ~1e-6 relative
//   over ~10 layers of O(1) activations, ~1e-5 on logits of size 8. 1e-4.
// - affine 4 / 8: `q * scale + bias` rounds once more in f32 (fused or not,
//   as the kernel likes); one ulp per weight is far below that summation
//   noise. 1e-4.
const MODES = [
  { name: 'affine4', opts: { mode: 'affine', bits: 4, groupSize: 32 }, tol: 1e-4 },
  { name: 'affine8', opts: { mode: 'affine', bits: 8, groupSize: 64 }, tol: 1e-4 },
  { name: 'mxfp4', opts: { mode: 'mxfp4', bits: 4, groupSize: 32 }, tol: 1e-4 },
  { name: 'mxfp8', opts: { mode: 'mxfp8', bits: 8, groupSize: 32 }, tol: 1e-4 },
  { name: 'nvfp4', opts: { mode: 'nvfp4', bits: 4, groupSize: 16 }, tol: 1e-4 },
];
const onCpu = addon.mlxInfo().backend === 'cpu';
const tolerance = (tol) => (onCpu ? 0 : tol);

// A mixed recipe: router at 8 bits (group 32, not the model default 64),
// the rest 4-bit affine, the value projections in another mode, and one
// layer left unquantized.
const MIXED = {
  opts: {
    mode: 'affine', bits: 4, groupSize: 32,
    overrides: [
      'feed_forward.gate=8',
      { pattern: '*.v_proj', bits: 8, groupSize: 32, mode: 'mxfp8' },
      { pattern: 'model.layers.1.*', skip: true },
    ],
  },
  ref: [
    { pattern: 'feed_forward.gate', bits: 8 },
    { pattern: '*.v_proj', bits: 8, group_size: 32, mode: 'mxfp8' },
    { pattern: 'model.layers.1.*', skip: true },
  ],
};

const work = path.join(os.tmpdir(), `mlx-lfm-quant-${process.pid}`);
process.on('exit', () => fs.rmSync(work, { recursive: true, force: true }));

function refConvertRequest(src, out, opts, overrides) {
  return {
    op: 'convert', model: src, out, quantize: opts.mode !== undefined,
    mode: opts.mode ?? 'affine', bits: opts.bits ?? null, group_size: opts.groupSize ?? null,
    dtype: opts.dtype ?? 'float32', overrides: overrides ?? [],
  };
}

let setupPromise;
/** Every checkpoint, mlx-lm's answers for each, and our conversion reports. */
function setup() {
  setupPromise ??= (async () => {
    fs.mkdirSync(work, { recursive: true });
    const src = {};
    for (const [k, [name, opts]] of Object.entries(SOURCES)) src[k] = await fixture(name, opts);
    // [key, source, our options, mlx-lm overrides]
    const jobs = [];
    for (const kind of ['dense', 'moe']) for (const m of MODES) jobs.push([`${kind}-${m.name}`, src[kind], m.opts]);
    jobs.push(['moe-mixed', src.moe, MIXED.opts, MIXED.ref]);
    jobs.push(['moe-bf16', src.moe, { dtype: 'bfloat16' }]);
    const ours = {};
    const theirs = {};
    const reports = {};
    const refReqs = [];
    for (const [key, s, opts, refOverrides] of jobs) {
      ours[key] = path.join(work, `ours-${key}`);
      theirs[key] = path.join(work, `mlxlm-${key}`);
      reports[key] = await addon.convert(s, ours[key], opts);
      refReqs.push(refConvertRequest(s, theirs[key], opts, refOverrides));
    }
    reference({ op: 'batch', requests: refReqs });
    // mlx-lm runs every checkpoint. Its CPU gather_mm is float32-only, so
    // the bf16 one goes last, with MLX's gather_mm emulated in f32 (the
    // emulation stays on in that process).
    const runDirs = [src.moe, src.moeMlx];
    for (const [key] of jobs) if (key !== 'moe-bf16') runDirs.push(ours[key], theirs[key]);
    runDirs.push(ours['moe-bf16']);
    const cases = promptNames.map((n) => ({ prompt: prompts[n], max_tokens: GEN }));
    const requests = runDirs.map((model) => ({ op: 'greedy', model, cases }));
    requests[requests.length - 1].upcast_gather_mm = true;
    const answers = reference({ op: 'batch', requests }).results;
    const ref = new Map(runDirs.map((d, i) => [d, answers[i].results]));
    return { src, ours, theirs, reports, ref };
  })();
  return setupPromise;
}

/** Our greedy tokens and first-step logits for every prompt. */
async function runOurs(dir, loadOptions = {}) {
  const model = await addon.Lfm2Model.load(dir, { prefillChunkSize: CHUNK, ...loadOptions });
  try {
    const out = [];
    for (const n of promptNames) {
      const r = await model.generate(prompts[n], { maxTokens: GEN, ignoreEos: true });
      out.push({ tokens: r.tokens, logits: await model.logits(prompts[n]) });
    }
    return { out, info: model.info() };
  } finally {
    model.close();
  }
}

/** Our run of `dir` against mlx-lm's; returns the largest logit difference. */
async function assertParity(s, dir, label, tol, loadOptions = {}) {
  const ours = await runOurs(dir, loadOptions);
  const ref = s.ref.get(dir);
  let worst = 0;
  for (let i = 0; i < promptNames.length; i++) {
    const what = `${label}, ${promptNames[i]} prompt`;
    assert.equal(ours.out[i].tokens.length, GEN, what);
    assert.deepEqual(ours.out[i].tokens, ref[i].tokens, `${what}: greedy tokens differ`);
    assert.ok(new Set(ours.out[i].tokens).size > 3, `${what}: degenerate output`);
    const d = maxAbsDiff(ours.out[i].logits, ref[i].logits);
    assert.ok(d <= tol, `${what}: first-step logits differ by ${d} (tolerance ${tol})`);
    worst = Math.max(worst, d);
  }
  return { worst, info: ours.info };
}

function readTensors(dir) {
  const idx = JSON.parse(fs.readFileSync(path.join(dir, 'model.safetensors.index.json'), 'utf8'));
  const tensors = new Map();
  const meta = new Map();
  for (const f of new Set(Object.values(idx.weight_map))) {
    const buf = fs.readFileSync(path.join(dir, f));
    const n = Number(buf.readBigUInt64LE(0));
    const header = JSON.parse(buf.subarray(8, 8 + n).toString('utf8'));
    for (const [name, t] of Object.entries(header)) {
      if (name === '__metadata__') {
        meta.set(f, t);
        continue;
      }
      const [a, b] = t.data_offsets;
      tensors.set(name, { dtype: t.dtype, shape: t.shape, data: buf.subarray(8 + n + a, 8 + n + b) });
    }
  }
  return { tensors, meta, index: idx };
}

function readConfig(dir) {
  return JSON.parse(fs.readFileSync(path.join(dir, 'config.json'), 'utf8'));
}

/** Tensor-by-tensor: the same names, dtypes, shapes and bytes. */
function assertSameTensors(oursDir, theirsDir, label) {
  const a = readTensors(oursDir);
  const b = readTensors(theirsDir);
  assert.deepEqual([...a.tensors.keys()].sort(), [...b.tensors.keys()].sort(), `${label}: tensor names differ`);
  for (const [name, t] of a.tensors) {
    const u = b.tensors.get(name);
    assert.equal(t.dtype, u.dtype, `${label}: ${name} dtype`);
    assert.deepEqual(t.shape, u.shape, `${label}: ${name} shape`);
    assert.ok(t.data.equals(u.data), `${label}: ${name} bytes differ`);
  }
  for (const m of a.meta.values()) assert.deepEqual(m, { format: 'mlx' });
  assert.deepEqual(Object.keys(a.index.weight_map), Object.keys(b.index.weight_map));
  assert.equal(a.index.metadata.total_size, b.index.metadata.total_size, `${label}: total_size`);
  return a.tensors.size;
}

test('lfm2_moe f32 (HF per-expert and MLX switch_mlp layouts) matches mlx-lm', async () => {
  const s = await setup();
  // The bound the dense f32 parity suite uses; measured: 0. The MLX-layout
  // run prefills in one chunk (90 routed rows: the sorted expert path).
  await assertParity(s, s.src.moe, 'tiny-moe f32 hf layout', 1e-3, { prefillChunkSize: CHUNK });
  await assertParity(s, s.src.moeMlx, 'tiny-moe f32 mlx layout', 1e-3, { prefillChunkSize: 2048 });
});

for (const kind of ['dense', 'moe']) {
  for (const m of MODES) {
    test(`${kind} ${m.name}: our runtime matches mlx-lm on checkpoints from both converters`, async (t) => {
      const s = await setup();
      const key = `${kind}-${m.name}`;
      // The two checkpoints are bitwise identical (checked below), so they
      // also cover both decode paths, the default (compiled) and eager, and
      // both MoE prefills: 16-token chunks route 32 rows (direct gathered
      // matmuls), one 45-token chunk routes 90 (>= 64: the sorted path).
      const runs = [
        ['mlx-lm', s.theirs[key], { prefillChunkSize: CHUNK }],
        ['ours', s.ours[key], { decodePath: 'eager', prefillChunkSize: 2048 }],
      ];
      for (const [who, dir, load] of runs) {
        const { worst, info } = await assertParity(s, dir, `${key} converted by ${who}`, tolerance(m.tol), load);
        assert.ok(info.quantization.some((q) => q.mode === m.opts.mode && q.bits === m.opts.bits && q.groupSize === m.opts.groupSize));
        t.diagnostic(`${key} (${who}, ${info.decodePath} decode): max |logit diff| ${worst}`);
      }
    });
  }
}

test('our converter writes what mlx-lm writes, tensor by tensor and bit for bit', async () => {
  const s = await setup();
  for (const key of Object.keys(s.ours)) {
    // Both quantize with the same MLX op on the same device, after the same
    // sanitize and cast, so every tensor is bitwise identical.
    assertSameTensors(s.ours[key], s.theirs[key], key);
    const ours = readConfig(s.ours[key]);
    const theirs = readConfig(s.theirs[key]);
    assert.deepEqual(ours.quantization, theirs.quantization, `${key}: quantization block`);
    assert.deepEqual(ours.quantization_config, theirs.quantization_config, `${key}: quantization_config block`);
    // Everything else in config.json is the source's, as mlx-lm keeps it
    // (mlx-lm also copies generation_config's eos_token_id, here the same).
    for (const c of [ours, theirs]) {
      delete c.quantization;
      delete c.quantization_config;
    }
    assert.deepEqual(ours, theirs, `${key}: config.json`);
  }
  const r = s.reports['moe-mxfp4'];
  assert.equal(r.sourceLayout, 'hf');
  assert.deepEqual(r.quantization.map((q) => [q.mode, q.bits, q.groupSize, q.projections]), [
    ['affine', 8, 64, 4],
    ['mxfp4', 4, 32, 35],
  ]);
  assert.deepEqual(r.unquantized, []);
  assert.deepEqual(r.copiedFiles, ['tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'generation_config.json']);
  const a8 = s.reports['moe-affine8'];
  assert.deepEqual(a8.unquantized.map((u) => u.path), [2, 3, 4, 5].map((l) => `model.layers.${l}.feed_forward.switch_mlp.down_proj`));
  assert.match(a8.unquantized[0].reason, /input width 32 is not a multiple of the group size 64/);
});

test('a mixed recipe (router at 8 bits, rest 4-bit, v_proj mxfp8, one layer skipped) loads in both and matches', async () => {
  const s = await setup();
  const cfg = readConfig(s.ours['moe-mixed']).quantization;
  assert.deepEqual(cfg['model.layers.2.feed_forward.gate'], { group_size: 32, bits: 8, mode: 'affine' });
  assert.deepEqual(cfg['model.layers.2.self_attn.v_proj'], { group_size: 32, bits: 8, mode: 'mxfp8' });
  assert.equal(cfg['model.layers.1.conv.in_proj'], undefined);
  const expected = [
    { mode: 'affine', bits: 4, groupSize: 32, projections: 28 },
    { mode: 'affine', bits: 8, groupSize: 32, projections: 4 },
    { mode: 'mxfp8', bits: 8, groupSize: 32, projections: 2 },
  ];
  for (const [who, dir] of [['mlx-lm', s.theirs['moe-mixed']], ['ours', s.ours['moe-mixed']]]) {
    const { info } = await assertParity(s, dir, `moe-mixed converted by ${who}`, tolerance(1e-4));
    // info().quantization summarises the formats in use.
    assert.deepEqual(info.quantization, expected, who);
  }
  assert.deepEqual(s.reports['moe-mixed'].unquantized.map((u) => u.path), [
    'model.layers.1.conv.in_proj', 'model.layers.1.conv.out_proj', 'model.layers.1.feed_forward.gate_proj',
    'model.layers.1.feed_forward.up_proj', 'model.layers.1.feed_forward.down_proj',
  ]);
});

const argmax = (a) => a.reduce((k, v, i) => (v > a[k] ? i : k), 0);

test('bf16 MoE runs on CPU and tracks our f32 run of the same weights', async (t) => {
  const s = await setup();
  const dir = s.ours['moe-bf16'];
  const st = readTensors(dir).tensors;
  assert.equal(st.get('model.layers.2.feed_forward.expert_bias').dtype, 'F32', 'expert_bias is never cast');
  assert.equal(st.get('model.layers.2.feed_forward.switch_mlp.up_proj.weight').dtype, 'BF16');
  // Default prefill chunk: the 45-token prompt routes 90 rows (>= 64), the
  // host-grouped prefill; decode and the short prompts take the upcast path.
  const load = { device: 'cpu', prefillChunkSize: 2048 };
  const bf16 = await addon.Lfm2Model.load(dir, load);
  const f32 = await addon.Lfm2Model.load(dir, { ...load, dtype: 'float32' });
  try {
    assert.equal(bf16.info().dtype, 'bfloat16');
    assert.equal(f32.info().dtype, 'float32');
    // bf16 keeps 8 significant bits, and the router's top-k is discrete: a
    // near-tie that rounds the other way sends a row to another expert and
    // moves the logits by several units. So the checks are:
    // - greedy decoding agrees for the first tokens (measured: 4, 64 and 28
    //   tokens for the three prompts), and along the f32 greedy path the
    //   bf16 argmax agrees at >= 28 of 32 teacher-forced positions per
    //   prompt (measured 30-32);
    // - first-step logits within 1.0 of f32 where routing agrees (measured
    //   0.43 and 0.51; for comparison, the DENSE tiny model in bf16, where
    //   mlx-lm and we agree bit for bit, is 0.40-0.66 away from f32);
    // - the long prompt's last position routes differently in bf16 (MoE
    //   layer 4 picks another expert; 4.24 from f32), so there we compare
    //   with mlx-lm itself, run in bf16 with its gather_mm emulated in f32
    //   (rounded back to bf16): our host-grouped prefill equals it exactly.
    const ref = s.ref.get(dir);
    for (let i = 0; i < promptNames.length; i++) {
      const p = prompts[promptNames[i]];
      const a = (await bf16.generate(p, { maxTokens: GEN, ignoreEos: true })).tokens;
      const b = (await f32.generate(p, { maxTokens: GEN, ignoreEos: true })).tokens;
      let same = 0;
      while (same < GEN && a[same] === b[same]) same++;
      assert.ok(same >= 4, `${promptNames[i]}: only ${same} greedy tokens agree: ${a} vs ${b}`);
      let agree = 0;
      for (let j = 0; j < GEN; j += 2) {
        const ids = p.concat(b.slice(0, j));
        if (argmax(await bf16.logits(ids)) === argmax(await f32.logits(ids))) agree++;
      }
      assert.ok(agree >= 28, `${promptNames[i]}: bf16 argmax agrees with f32 at only ${agree}/32 positions`);
      // A cold prefill of the whole prompt, as mlx-lm runs it: the loop above
      // left this prompt's prefix in the paged cache, and a hit runs only the
      // suffix (in bf16 a different chunking moves the low bits).
      await bf16.clearPrefixCache();
      await f32.clearPrefixCache();
      const la = await bf16.logits(p);
      const d = maxAbsDiff(la, await f32.logits(p));
      t.diagnostic(`bf16 vs f32, ${promptNames[i]}: ${same} identical tokens, ${agree}/32 argmax, first-step max |logit diff| ${d}`);
      if (promptNames[i] === 'long') {
        assert.equal(maxAbsDiff(la, ref[i].logits), 0, 'long prompt: host-grouped bf16 prefill differs from mlx-lm (emulated gather_mm)');
      } else {
        assert.ok(d < 1.0, `${promptNames[i]}: bf16 first-step logits differ from f32 by ${d}`);
      }
    }
  } finally {
    bf16.close();
    f32.close();
  }
});

test('the quant registry: `false` entries with .scales fail, entries without mode are affine', async () => {
  const s = await setup();
  // mlx-lm writes the router entry without a mode, under a global mxfp4
  // block: it must load as affine 8-bit (inheriting mxfp4 would be invalid).
  const mx = readConfig(s.theirs['moe-mxfp4']).quantization;
  assert.deepEqual(mx['model.layers.3.feed_forward.gate'], { group_size: 64, bits: 8 });
  const m = await addon.Lfm2Model.load(s.theirs['moe-mxfp4']);
  assert.deepEqual(m.info().quantization, [
    { mode: 'affine', bits: 8, groupSize: 64, projections: 4 },
    { mode: 'mxfp4', bits: 4, groupSize: 32, projections: 35 },
  ]);
  m.close();
  const plain = await addon.Lfm2Model.load(s.src.dense);
  assert.deepEqual(plain.info().quantization, []);
  plain.close();

  // A config that turns off a projection that has .scales names it.
  const bad = path.join(work, 'registry-false');
  fs.cpSync(s.ours['moe-mxfp4'], bad, { recursive: true });
  const cfg = readConfig(bad);
  for (const k of ['quantization', 'quantization_config']) cfg[k]['model.layers.2.self_attn.k_proj'] = false;
  fs.writeFileSync(path.join(bad, 'config.json'), JSON.stringify(cfg));
  await assert.rejects(addon.Lfm2Model.load(bad), /projection `model\.layers\.2\.self_attn\.k_proj` has a \.scales tensor but config\.json's quantization turns it off/);
});

test('converter errors name the problem', async () => {
  const s = await setup();
  const out = path.join(work, 'errors');
  await assert.rejects(async () => addon.convert(s.src.dense, out, { mode: 'mxfp4', bits: 8 }), /mxfp4 with bits=8 group_size=32 is not supported/);
  await assert.rejects(async () => addon.convert(s.src.dense, out, { mode: 'fp4' }), /mode `fp4` is not valid/);
  await assert.rejects(async () => addon.convert(s.src.dense, out, { mode: 'affine', overrides: ['feed_forward.gate=8'] }), /`feed_forward.gate` matches no quantizable module/);
  await assert.rejects(async () => addon.convert(path.join(work, 'missing'), out, { mode: 'affine' }), /source model path .*missing is not a directory/);
  await assert.rejects(async () => addon.convert(s.src.dense, s.ours['dense-mxfp4'], { mode: 'affine' }), /already exists and is not empty/);
  await assert.rejects(async () => addon.convert(s.ours['dense-mxfp4'], out, {}), /is already quantized/);
  const file = path.join(work, 'a-file');
  fs.writeFileSync(file, '');
  await assert.rejects(async () => addon.convert(s.src.dense, path.join(file, 'x'), { mode: 'affine' }), /output directory .*a-file\/x cannot be created/);
  assert.ok(!fs.existsSync(out));
});

test('`mlx-lfm convert` quantizes with overrides', async () => {
  const s = await setup();
  const out = path.join(work, 'cli-out');
  const r = spawnSync(process.execPath, [path.join(root, 'cli.cjs'), 'convert', '--model', s.src.moe, '--out', out,
    '--q-mode', 'mxfp4', '--q-bits', '4', '--q-group-size', '32', '--q-override', 'embed_tokens=skip',
    '--q-override', 'feed_forward.gate=8:64:affine'], { encoding: 'utf8' });
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, /quantized: affine 8-bit group 64 x4, mxfp4 4-bit group 32 x34/);
  assert.match(r.stdout, /not quantized: model\.embed_tokens \(skipped by override `embed_tokens`\)/);
  const q = readConfig(out).quantization;
  assert.deepEqual(q['model.layers.2.feed_forward.gate'], { group_size: 64, bits: 8, mode: 'affine' });
  const bad = spawnSync(process.execPath, [path.join(root, 'cli.cjs'), 'convert', '--model', s.src.moe, '--out', out + '2',
    '--q-override', 'x=8'], { encoding: 'utf8' });
  assert.equal(bad.status, 1);
  assert.match(bad.stderr, /--q-override needs quantization/);
});
