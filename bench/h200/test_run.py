#!/usr/bin/env python3
"""Tests of bench/h200/run.py's own logic, on any machine (no GPU, no
device call): what a device session cannot afford to find out on the
device. Each test points run.py's folders at a temporary one and stubs
what would reach the machine (nvidia-smi, ncu, the bench binary).

    python3 bench/h200/test_run.py      (npm test runs it: __test__/bench-driver.test.cjs)
"""
import csv
import importlib.util
import io
import json
import os
import re
import tarfile
import sys
import tempfile
import time
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_run(work):
    """A fresh run.py module whose machine folders are under `work`."""
    spec = importlib.util.spec_from_file_location("h200_run", HERE / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    run.WORK = work
    run.OUT = work / "out"
    run.RAW = work / "raw.jsonl"
    run.PTX = work / "ptx"
    run.MLX_TEMP_PTX = work / "tmp-mlx"
    run.GGUF_PID = work / "gguf.pid"
    run.GGUF_RC = work / "gguf.rc"
    run.GGUF_OUT = work / "gguf-out"
    run.PICKED = work / "picked-env.json"
    run.OUT.mkdir(parents=True, exist_ok=True)
    return run


def records(run):
    return [json.loads(l) for l in run.RAW.read_text().splitlines()] if run.RAW.exists() else []


class Result:
    def __init__(self, stdout="", returncode=0, stderr=""):
        self.stdout, self.returncode, self.stderr = stdout, returncode, stderr


class KernelBench(unittest.TestCase):
    """ncu lists kernels in launch order; run.py gives each arm its share by
    the plan's launch counts, and must stop at an arm that failed."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.run = load_run(Path(self.tmp.name))

    def tearDown(self):
        self.tmp.cleanup()

    def bench(self, plan, walls, launched):
        """kernel_bench() over a fake ncu: `launched` (arm, count) rows in order."""
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=["ID", "Kernel Name", "gpu__time_duration.sum", "dram__bytes_read.sum"])
        w.writeheader()
        i = 0
        for arm, n in launched:
            for _ in range(n):
                w.writerow({"ID": str(i), "Kernel Name": f"custom_kernel_{arm}_0123456789abcdef_2048_bfloat16",
                            "gpu__time_duration.sum": str(1000 + i), "dram__bytes_read.sum": "100"})
                i += 1
        stdout = "\n".join([json.dumps({"kernel_bench_plan": plan})] + [json.dumps(x) for x in walls])
        self.run.sh = lambda cmd, *a, **k: Result(buf.getvalue() if "--import" in cmd else stdout)
        self.run.kernel_bench()
        return [r for r in records(self.run) if r.get("arm")]

    def plan_and_walls(self, arms):
        plan = [{"arm": a, "n": 64, "k": 32, "launches": n} for a, n in arms]
        walls = [{"kernel_bench": a, "n": 64, "k": 32, "launches": n, "wall_us_median": 5.0} for a, n in arms]
        return plan, walls

    def test_each_arm_gets_its_launches_in_order(self):
        plan, walls = self.plan_and_walls([("a", 3), ("b", 2), ("c", 4)])
        got = self.bench(plan, walls, [("a", 3), ("b", 2), ("c", 4)])
        self.assertEqual([(r["arm"], r["launches"]) for r in got], [("a", 3), ("b", 2), ("c", 4)])
        # Each arm's kernels are its own (the hash dropped, the template values kept).
        self.assertEqual(got[1]["kernels"], ["custom_kernel_b_2048_bfloat16"])
        self.assertEqual(got[2]["us_median"], (1000 + 5 + 2) / 1000)

    def test_attribution_stops_at_a_failed_arm(self):
        plan, walls = self.plan_and_walls([("a", 3), ("b", 2), ("c", 4)])
        walls[1].update(error="boom", launches=1)
        got = self.bench(plan, walls, [("a", 3), ("b", 1), ("c", 4)])
        self.assertEqual(got[0]["launches"], 3)
        self.assertEqual(got[1]["error"], "boom")
        self.assertIn("not attributed", got[2]["error"])
        self.assertNotIn("us_median", got[2])

    def test_attribution_stops_where_the_process_ended(self):
        plan, walls = self.plan_and_walls([("a", 3), ("b", 2)])
        got = self.bench(plan, walls[:1], [("a", 3)])
        self.assertEqual(got[0]["launches"], 3)
        self.assertIn("process ended", got[1]["error"])

    def test_short_kernel_keeps_template_values(self):
        name = "custom_kernel_lfm_moe_down_cols_0123456789abcdef_1792_4_64_bfloat16_4_2_305419896"
        self.assertEqual(self.run.short_kernel(name), "custom_kernel_lfm_moe_down_cols_1792_4_64_bfloat16_4_2_305419896")


class SourcePage(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.run = load_run(Path(self.tmp.name))

    def tearDown(self):
        self.tmp.cleanup()

    def test_the_most_sampled_instructions_come_first(self):
        # ncu prints a kernel's name line before the table; only rows with
        # commas are kept.
        text = ('"Kernel Name","custom_kernel_lfm_moe_down_0123_1792",\n'
                '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"\n'
                '"00000010","LDG.E.128 R4, desc[UR4][R2.64]","1,200","1,100"\n'
                '"00000020","FFMA R1, R2, R3, R1","40","10"\n'
                '"00000030","EXIT","0","0"\n'
                '"00000008","LDG.E R0, desc[UR4][R6.64]","300","290"\n')
        got = self.run.summarize_source(text, top=3)
        self.assertEqual([g[0] for g in got], ["00000010", "00000008", "00000020"])
        self.assertEqual(got[0][2:], [1200.0, 1100.0])

    def test_an_unknown_layout_gives_nothing(self):
        self.assertEqual(self.run.summarize_source('"a","b"\n"1","2"\n'), [])
        self.assertEqual(self.run.summarize_source(""), [])


class PtxCache(unittest.TestCase):
    """The compiled kernels a session brings back, and where the next may
    load them."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.run = load_run(Path(self.tmp.name))
        self.run.gpu_capability = lambda: "9.0"
        self.run.mlx_version = lambda: "0.32.4"
        self.run.PTX.mkdir()
        for i, name in enumerate(["custom_kernel_lfm_a", "custom_kernel_lfm_b", "binary_add", "copy_gg"]):
            (self.run.PTX / f"{name}.ptx").write_bytes(os.urandom(40_000 + i))
            (self.run.PTX / f"{name}.txt").write_text(f"{name}\t_Z{i}\n")
            (self.run.PTX / f"{name}.cu").write_text("source")

    def tearDown(self):
        self.tmp.cleanup()

    def saved(self):
        with tarfile.open(self.run.OUT / "ptx-cache.tgz", "r:gz") as t:
            return sorted(m.name for m in t.getmembers())

    def test_round_trip_without_sources(self):
        self.run.save_ptx()
        self.assertEqual(len(self.saved()), 9)
        self.assertFalse(any(n.endswith(".cu") for n in self.saved()))
        self.run.PTX_CARRY = self.run.OUT / "ptx-cache.tgz"
        self.run.PTX = self.run.WORK / "fresh"
        self.run.restore_ptx()
        self.assertEqual(len(list(self.run.PTX.iterdir())), 8)
        self.assertEqual(records(self.run)[-1]["restored"], 8)

    def test_mlx_default_folder_is_saved_too(self):
        # A process without MLX_PTX_CACHE_DIR writes into <temp>/mlx/<version>/ptx.
        other = self.run.MLX_TEMP_PTX / "0.32.4" / "ptx"
        other.mkdir(parents=True)
        (other / "custom_kernel_lfm_c.ptx").write_bytes(b"cubin")
        (other / "custom_kernel_lfm_c.txt").write_text("c\t_Zc\n")
        (other / "binary_add.ptx").write_bytes(b"a copy of one ours has")
        self.run.save_ptx()
        names = self.saved()
        self.assertIn("custom_kernel_lfm_c.ptx", names)
        self.assertEqual(names.count("binary_add.ptx"), 1)
        self.assertEqual(len(names), 11)
        rec = records(self.run)[-1]
        self.assertEqual(rec["folders"], {str(self.run.PTX): 12, str(other): 2})
        self.run.PTX_CARRY = self.run.OUT / "ptx-cache.tgz"
        self.run.PTX = self.run.WORK / "fresh"
        self.run.restore_ptx()
        self.assertEqual(records(self.run)[-1]["restored"], 10)

    def test_a_half_written_module_is_left_out(self):
        # A test process killed at a TERM between MLX's writes.
        (self.run.PTX / "custom_kernel_lfm_torn.ptx").write_bytes(b"cubin")
        (self.run.PTX / "custom_kernel_lfm_empty.ptx").write_bytes(b"cubin")
        (self.run.PTX / "custom_kernel_lfm_empty.txt").write_text("")
        (self.run.PTX / "custom_kernel_lfm_nocode.ptx").write_bytes(b"")
        (self.run.PTX / "custom_kernel_lfm_nocode.txt").write_text("n\t_Zn\n")
        self.run.save_ptx()
        self.assertEqual(len(self.saved()), 9, "the whole modules only")
        self.assertEqual(records(self.run)[-1]["torn"],
                         ["custom_kernel_lfm_empty", "custom_kernel_lfm_nocode", "custom_kernel_lfm_torn"])

    def test_too_large_keeps_ours_first(self):
        self.run.save_ptx(limit=100_000)
        names = self.saved()
        self.assertIn("custom_kernel_lfm_a.ptx", names)
        self.assertNotIn("copy_gg.ptx", names)
        self.assertLessEqual((self.run.OUT / "ptx-cache.tgz").stat().st_size, 100_000)

    def test_another_gpu_or_mlx_restores_nothing(self):
        self.run.save_ptx()
        self.run.PTX_CARRY = self.run.OUT / "ptx-cache.tgz"
        for cc, version in [("10.0", "0.32.4"), ("9.0", "0.33.0"), (None, "0.32.4"), ("9.0", None)]:
            self.run.PTX = self.run.WORK / f"fresh-{cc}-{version}"
            self.run.gpu_capability = lambda cc=cc: cc
            self.run.mlx_version = lambda version=version: version
            self.run.restore_ptx()
            self.assertFalse(self.run.PTX.exists(), (cc, version))
            self.assertEqual(records(self.run)[-1]["restored"], 0)

    def test_pack_logs_leaves_the_cache_and_raw_file_apart(self):
        self.run.save_ptx()
        (self.run.OUT / "raw.jsonl").write_text("{}\n")
        (self.run.OUT / "a.log").write_text("log")
        self.run.pack_logs()
        self.assertEqual(sorted(p.name for p in self.run.OUT.iterdir()), ["logs.tgz", "ptx-cache.tgz", "raw.jsonl"])


def step_run(case, model, fields):
    """A run.py over a temporary folder (case.tmp, case.run) whose step
    profiles take `model` alone from its checkpoint under /ck; and a CSV
    writer of ncu's page with `fields`, header written, over its buffer."""
    case.tmp = tempfile.TemporaryDirectory()
    case.run = load_run(Path(case.tmp.name))
    case.run.ab_models = lambda: [model]
    case.run.ours_ck = lambda name: "/ck/" + name
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    return buf, w


class ProfileGaps(unittest.TestCase):
    """profile-gaps: the step's GPU time as one graph less its kernels' warm
    ncu durations."""

    def setUp(self):
        buf, w = step_run(self, "lfm2-1.2b-bf16", ["ID", "Kernel Name", "gpu__time_duration.sum"])
        for i, (k, ns) in enumerate([("gemv_single", "8,000"), ("custom_kernel_lfm_add_rms_norm_0123456789abcdef", "3000"),
                                     ("gemv_single", "6000")]):
            w.writerow({"ID": str(i), "Kernel Name": k, "gpu__time_duration.sum": ns})
        self.csv = buf.getvalue()
        self.calls = []

    def tearDown(self):
        self.tmp.cleanup()

    def fake(self, bench_stdout):
        def sh(cmd, *a, **k):
            self.calls.append((list(map(str, cmd)), k.get("env") or {}))
            if "--import" in cmd:
                return Result(self.csv)
            if cmd[0] == "ncu":
                return Result()
            return Result(bench_stdout)
        self.run.sh = sh

    def test_gaps_are_the_graph_time_less_the_kernels(self):
        line = {"path": "compiled", "host_build_dispatch_wait_us_runs": [[100, 50, 2, 40.0], [90, 40, 2, 30.0], [95, 45, 2, 35.0]]}
        self.fake("{\"mlx\": \"0.32.4\"}\n" + json.dumps(line))
        self.run.profile_gaps()
        rec = [r for r in records(self.run) if r.get("engine") == "profile-gaps"][-1]
        self.assertEqual(rec["kernels"], 3)
        self.assertAlmostEqual(rec["kernel_us_warm"], 17.0)
        self.assertEqual(rec["gpu_step_us"], 35.0)
        self.assertAlmostEqual(rec["gaps_us"], 18.0)
        ncu = next(c for c, _ in self.calls if c[0] == "ncu" and "--import" not in c)
        self.assertIn("--cache-control", ncu)
        self.assertEqual(ncu[ncu.index("--cache-control") + 1], "none")
        bench_env = next(e for c, e in self.calls if c[0] != "ncu")
        self.assertEqual(bench_env.get("MLX_LFM_SYNC_STEPS"), "1")

    def test_no_wait_figures_give_no_gaps(self):
        self.fake("not json\n" + json.dumps({"host_build_dispatch_wait_us_runs": [[1, 2, 3]]}))
        self.run.profile_gaps()
        rec = [r for r in records(self.run) if r.get("engine") == "profile-gaps"][-1]
        self.assertIsNone(rec["gpu_step_us"])
        self.assertIsNone(rec["gaps_us"])


class ProfileKernels(unittest.TestCase):
    """profile-kernels: H200_NCU_COUNT bounds the launches ncu replays in
    both of its runs (session 51's 8B-A1B step outran its call)."""

    def setUp(self):
        buf, w = step_run(self, "lfm2-8b-a1b-q4", ["ID", "Kernel Name", "Metric Name", "Metric Value"])
        w.writerow({"ID": "0", "Kernel Name": "custom_kernel_lfm_moe_fused_0123456789abcdef", "Metric Name": "Duration",
                    "Metric Value": "38,000"})
        self.csv = buf.getvalue()
        self.ncu = []

        def sh(cmd, *a, **k):
            cmd = list(map(str, cmd))
            if "--import" in cmd:
                return Result(self.csv)
            self.ncu.append(cmd)
            return Result()
        self.run.sh = sh
        self.saved = os.environ.get("H200_NCU_COUNT")

    def tearDown(self):
        if self.saved is None:
            os.environ.pop("H200_NCU_COUNT", None)
        else:
            os.environ["H200_NCU_COUNT"] = self.saved
        self.tmp.cleanup()

    def test_the_count_reaches_both_runs(self):
        os.environ["H200_NCU_COUNT"] = "8"
        self.run.profile_kernels()
        self.assertEqual(len(self.ncu), 2)
        for cmd in self.ncu:
            i = cmd.index("--launch-count")
            self.assertEqual(cmd[i + 1], "8")
            # (Before the program's own arguments, which ncu would pass on.)
            self.assertLess(i, cmd.index("--model"))
        detail = [r for r in records(self.run) if r.get("engine") == "ncu-detail"]
        self.assertEqual(detail[0]["kernels"]["custom_kernel_lfm_moe_fused_0123456789abcdef"]["Duration"], "38,000")

    def test_stalls_only_skips_the_detail_pass(self):
        os.environ["H200_NCU_STALLS_ONLY"] = "1"
        try:
            self.run.profile_kernels()
        finally:
            os.environ.pop("H200_NCU_STALLS_ONLY", None)
        self.assertEqual(len(self.ncu), 1)
        self.assertTrue(any("ncu-stalls" in c for c in self.ncu[0]), self.ncu[0])
        self.assertFalse([r for r in records(self.run) if r.get("engine") == "ncu-detail"])

    def test_unset_replays_every_launch(self):
        os.environ.pop("H200_NCU_COUNT", None)
        self.run.profile_kernels()
        self.assertTrue(self.ncu and all("--launch-count" not in cmd for cmd in self.ncu))

    def test_a_count_that_is_not_a_number_stops_before_ncu(self):
        for bad in ("0", "-3", "all", "2.5"):
            os.environ["H200_NCU_COUNT"] = bad
            with self.assertRaises(SystemExit):
                self.run.profile_kernels()
        self.assertEqual(self.ncu, [])


class GgufBackground(unittest.TestCase):
    """What a round does about a GGUF chain started in the background."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.run = load_run(Path(self.tmp.name))
        (self.run.WORK / "gguf-bg.log").write_text("chain")
        os.environ["H200_GGUF_WAIT"] = "1"

    def tearDown(self):
        os.environ.pop("H200_GGUF_WAIT", None)
        self.tmp.cleanup()

    def test_no_chain_changes_nothing(self):
        self.assertTrue(self.run.wait_gguf())
        self.assertEqual(records(self.run), [])

    def test_a_finished_chain_brings_its_logs(self):
        self.run.GGUF_PID.write_text("999999999")
        self.run.GGUF_RC.write_text("0")
        self.run.GGUF_OUT.mkdir()
        with tarfile.open(self.run.GGUF_OUT / "logs.tgz", "w:gz") as t:
            data = b"converted"
            info = tarfile.TarInfo("convert.log")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        self.assertTrue(self.run.wait_gguf())
        self.assertEqual((self.run.OUT / "gguf-bg-convert.log").read_text(), "converted")
        self.assertEqual(records(self.run)[-1]["rc"], "0")

    def test_a_running_chain_is_not_converted_beside(self):
        self.run.GGUF_PID.write_text(str(os.getpid()))
        self.assertFalse(self.run.wait_gguf())
        self.assertEqual(records(self.run)[-1]["rc"], "still running")

    def test_a_dead_chain_lets_the_round_convert(self):
        self.run.GGUF_PID.write_text("999999999")
        os.environ["H200_GGUF_WAIT"] = "30"
        self.assertTrue(self.run.wait_gguf())
        self.assertEqual(records(self.run)[-1]["rc"], "ended without a verdict")


class RoundsStop(unittest.TestCase):
    """A SIGTERM ends the rounds at once; an engine's own failure does not."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.run = load_run(Path(self.tmp.name))
        self.ran = []
        for f in ("install", "checkpoints"):
            setattr(self.run, f, lambda *a, **k: None)
        self.run.wait_gguf = lambda: True
        self.run.round_models = lambda: ["a", "b"]

    def tearDown(self):
        self.tmp.cleanup()

    def engine(self, name, fails=None):
        def f(model, rnd):
            self.ran.append((name, model))
            if fails:
                raise fails
        f.__name__ = name
        return f

    def test_an_engine_failure_goes_on(self):
        self.run.run_llama = self.engine("run_llama", SystemExit("failed (1): llama-bench"))
        self.run.run_ours = self.engine("run_ours")
        self.run.run_mlx_lm = self.engine("run_mlx_lm")
        self.run.rounds(1)
        self.assertEqual(len(self.ran), 6)
        self.assertIn("llama-bench", [r for r in records(self.run) if r.get("engine") == "run_llama"][0]["error"])

    def test_sigterm_stops_the_rounds(self):
        self.run.run_llama = self.engine("run_llama")
        self.run.run_ours = self.engine("run_ours", self.run.Stopped("stopped by SIGTERM"))
        self.run.run_mlx_lm = self.engine("run_mlx_lm")
        with self.assertRaises(self.run.Stopped):
            self.run.rounds(1)
        self.assertEqual(self.ran, [("run_llama", "a"), ("run_ours", "a")])

    def test_a_cut_test_call_still_saves_the_compiled_kernels(self):
        """`kernels save-ptx` cut in its tests still saves what they
        compiled; a call without save-ptx saves nothing."""
        saved = []
        self.run.save_ptx = lambda *a: saved.append(1)
        self.run.pack_logs = lambda: None

        def cut():
            raise self.run.Stopped("stopped by SIGTERM")
        self.run.kernels = cut
        argv = sys.argv
        try:
            for args, want in ((["kernels", "save-ptx"], [1]), (["kernels"], [])):
                saved.clear()
                sys.argv = ["run.py", *args]
                with self.assertRaises(SystemExit):
                    self.run.main()
                self.assertEqual(saved, want, args)
        finally:
            sys.argv = argv

    def test_the_handler_raises_what_the_rounds_do_not_catch(self):
        with self.assertRaises(self.run.Stopped):
            self.run.on_sigterm(15, None)
        self.assertFalse(issubclass(self.run.Stopped, (SystemExit, Exception)))


class AfterTheTerm(unittest.TestCase):
    """After the first SIGTERM (the second, timeout's copy to the process
    group, is taken as the same one) nothing starts that could keep the
    call past its limit, and `finally` still packs raw.jsonl and logs."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.run = load_run(Path(self.tmp.name))

    def tearDown(self):
        self.tmp.cleanup()

    def term(self):
        with self.assertRaises(self.run.Stopped):
            self.run.on_sigterm(15, None)
        self.assertIsNone(self.run.on_sigterm(15, None), "the group's copy is the same TERM")

    def test_a_worker_starts_no_command_after_it(self):
        import threading

        self.term()
        got = []
        t = threading.Thread(target=lambda: got.append(self.catch(lambda: self.run.sh(["true"]))))
        t.start()
        t.join()
        self.assertIsInstance(got[0], self.run.Stopped)
        self.assertEqual(self.run.sh(["true"]).returncode, 0, "the main thread's wrap-up still runs commands")

    def catch(self, f):
        try:
            return f()
        except BaseException as e:
            return e

    def test_the_wait_for_llama_cpp_ends_at_it(self):
        import types

        self.term()

        def slept(_):
            raise AssertionError("the wait went on past the TERM")
        self.run.time = types.SimpleNamespace(time=time.time, sleep=slept)
        with self.assertRaises(self.run.Stopped):
            self.run.wait_llama()

    def test_the_queued_gguf_chains_do_not_start(self):
        run = self.run
        run.CK = Path(self.tmp.name) / "ck"
        run.GGUF = Path(self.tmp.name) / "gguf"
        started = []

        def gguf_of(name, *_):
            started.append(name)
            time.sleep(0.3)
        run.gguf_of = gguf_of
        names = list(run.MODELS)

        def sh(cmd, *a, **k):
            # Each model's generation; the third's meets the TERM, with the
            # first model's chain running and the second's queued.
            out = Path(str(cmd[cmd.index("--out") + 1]))
            if names[2] in str(out) or out.name.startswith(run.MODELS[names[2]][0]):
                time.sleep(0.05)
                run.on_sigterm(15, None)
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text("{}")
            return Result("")
        run.sh = sh
        with self.assertRaises(run.Stopped):
            run.checkpoints()
        # (Leaving checkpoints joined the running chain.)
        self.assertEqual(started, [names[0]], "the queued chain never started")


class Install(unittest.TestCase):
    """A call that needs MLX before the wheel's halves are here says which."""

    def test_a_missing_half_is_named(self):
        with tempfile.TemporaryDirectory() as tmp:
            run = load_run(Path(tmp))
            run.ROOT = Path(tmp)
            run.SITE = Path(tmp) / "site"
            with self.assertRaises(SystemExit) as e:
                run.install_wheels()
            self.assertIn(".device/b", str(e.exception))
            self.assertIn("cuda.part.ab", str(e.exception))


class DeviceOf(unittest.TestCase):
    """The rounds' figures name the card they ran on (the device tool may
    lend an H100 where an H200 is asked for)."""

    def test_the_rounds_name_their_card(self):
        with tempfile.TemporaryDirectory() as tmp:
            run = load_run(Path(tmp))
            rows = [{"engine": "env", "round": 1, "gpu": "NVIDIA H100 80GB HBM3"}, {"engine": "mlx-lfm"}]
            self.assertEqual(run.device_of(rows), "NVIDIA H100 80GB HBM3")

    def test_older_records_take_the_override_or_the_h200(self):
        with tempfile.TemporaryDirectory() as tmp:
            run = load_run(Path(tmp))
            rows = [{"engine": "env", "round": 1}]
            old = os.environ.pop("H200_DEVICE", None)
            try:
                self.assertEqual(run.device_of(rows), "NVIDIA H200")
                os.environ["H200_DEVICE"] = "NVIDIA H100 80GB HBM3"
                self.assertEqual(run.device_of(rows), "NVIDIA H100 80GB HBM3")
            finally:
                os.environ.pop("H200_DEVICE", None)
                if old is not None:
                    os.environ["H200_DEVICE"] = old


class OursPreload(unittest.TestCase):
    """H200_OURS_ENV's preload: `<ROOT>` is the checkout's root, a preload
    that names no file stops the round, and a bench that says another
    allocator served it leaves an error (sessions 56 and 57 ran glibc
    believing they ran mimalloc)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.run = load_run(Path(self.tmp.name))
        self.run.ROOT = Path(self.tmp.name)
        self.run.ours_ck = lambda name: Path(self.tmp.name) / name
        self.lib = Path(self.tmp.name) / ".device" / "bin" / "libmimalloc.so"
        self.saved = {k: os.environ.pop(k, None) for k in ("H200_OURS_ENV", "H200_GLIBC_BATCHED")}
        os.environ["H200_OURS_ENV"] = json.dumps({"LD_PRELOAD": "<ROOT>/.device/bin/libmimalloc.so"})

    def tearDown(self):
        for k, v in self.saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
        self.tmp.cleanup()

    def bench(self, served_by_preload):
        """A fake bench: its allocator line names the preload when the
        process's environment has it and `served_by_preload`."""
        calls = []

        def sh(cmd, log_name=None, check=True, env=None, **k):
            pre = (env or {}).get("LD_PRELOAD")
            calls.append((log_name, pre))
            alloc = pre if pre and served_by_preload else "/lib/x86_64-linux-gnu/libc.so.6"
            if "--concurrent" in map(str, cmd):
                out = {"median_step_ms": 4.0, "solo_step_ms": 1.0, "concurrent_tps": 3000.0}
            else:
                out = {"prompt": 512, "prefill_tps_runs": [1.0], "decode_tps_runs": [2.0], "cache": "paged"}
            return Result("\n".join([json.dumps({"allocator": alloc}), json.dumps(out)]) + "\n")

        self.run.sh = sh
        return calls

    def test_root_is_the_checkouts_and_a_missing_file_stops(self):
        with self.assertRaises(SystemExit) as e:
            self.run.ours_extra()
        self.assertIn(str(self.lib), str(e.exception))
        self.lib.parent.mkdir(parents=True)
        self.lib.write_bytes(b"")
        self.assertEqual(self.run.ours_extra(), {"LD_PRELOAD": str(self.lib)})

    def test_the_round_stops_before_any_engine(self):
        ran = []
        self.run.install = lambda: ran.append("install")
        with self.assertRaises(SystemExit):
            self.run.rounds(1)
        self.assertEqual(ran, [])

    def test_a_preload_the_bench_did_not_get_is_an_error(self):
        self.lib.parent.mkdir(parents=True)
        self.lib.write_bytes(b"")
        self.bench(served_by_preload=False)
        self.run.run_ours("lfm2-350m-bf16", 1)
        errors = [r for r in records(self.run) if r.get("error")]
        self.assertTrue(errors and "not the preloaded" in errors[0]["error"], errors)
        self.assertEqual(errors[0]["engine"], "run_ours")

    def test_a_null_allocator_is_an_error_not_a_crash(self):
        self.lib.parent.mkdir(parents=True)
        self.lib.write_bytes(b"")
        self.run.sh = lambda cmd, *a, **k: Result(json.dumps({"allocator": None}) + "\n")
        self.run.run_ours("lfm2-1.2b-bf16", 1)
        self.assertTrue([r for r in records(self.run) if "not the preloaded" in r.get("error", "")])

    def test_a_bare_library_name_is_the_loaders_to_find(self):
        os.environ["H200_OURS_ENV"] = json.dumps({"LD_PRELOAD": "libjemalloc.so.2"})
        self.assertEqual(self.run.ours_extra(), {"LD_PRELOAD": "libjemalloc.so.2"})

    def test_the_glibc_twin_keeps_the_other_switches_and_a_failure_is_recorded(self):
        self.lib.parent.mkdir(parents=True)
        self.lib.write_bytes(b"")
        os.environ["H200_OURS_ENV"] = json.dumps({"LD_PRELOAD": "<ROOT>/.device/bin/libmimalloc.so", "MLX_LFM_X": "1"})
        os.environ["H200_GLIBC_BATCHED"] = "1"
        seen = []

        def sh(cmd, log_name=None, check=True, env=None, **k):
            seen.append((log_name, env.get("LD_PRELOAD"), env.get("MLX_LFM_X")))
            if log_name == "ours-glibc-batched-lfm2-1.2b-bf16":
                return Result("", returncode=1, stderr="boom")
            if "--concurrent" in map(str, cmd):
                return Result(json.dumps({"median_step_ms": 4.0, "solo_step_ms": 1.0, "concurrent_tps": 3000.0}) + "\n")
            return Result(json.dumps({"allocator": env.get("LD_PRELOAD") or "libc.so.6"}) + "\n")

        self.run.sh = sh
        self.run.run_ours("lfm2-1.2b-bf16", 1)
        glibc = [x for x in seen if x[0] and "glibc" in x[0]]
        self.assertEqual([(p, x) for _, p, x in glibc], [(None, "1"), (None, "1")])
        errors = [r for r in records(self.run) if r.get("engine") == "mlx-lfm-glibc" and "error" in r]
        self.assertTrue(errors and "boom" in errors[0]["error"], errors)

    def test_a_served_preload_is_no_error_and_glibc_batched_is_opt_in(self):
        self.lib.parent.mkdir(parents=True)
        self.lib.write_bytes(b"")
        calls = self.bench(served_by_preload=True)
        self.run.run_ours("lfm2-350m-bf16", 1)
        self.assertFalse([r for r in records(self.run) if r.get("error")])
        batched = lambda: [(r["engine"], r["metric"]) for r in records(self.run) if r.get("metric", "").startswith("batch16_decode")]
        self.assertEqual(batched(), [("mlx-lfm", "batch16_decode_tps")])
        os.environ["H200_GLIBC_BATCHED"] = "1"
        calls.clear()
        self.run.RAW.unlink()
        self.run.run_ours("lfm2-350m-bf16", 1)
        self.assertEqual(batched(), [("mlx-lfm", "batch16_decode_tps"), ("mlx-lfm-glibc", "batch16_decode_tps")])
        glibc = [pre for name, pre in calls if name == "ours-glibc-batched-lfm2-350m-bf16"]
        self.assertEqual(glibc, [None])


class BatchPhases(unittest.TestCase):
    """`batch-phases` times the 16-row step pipelined and synced, then
    counts its nodes in a process of its own (the count's walk is host
    time a step, so never in a timed arm)."""

    def test_the_nodes_come_from_their_own_process(self):
        with tempfile.TemporaryDirectory() as tmp:
            run = load_run(Path(tmp))
            run.ours_ck = lambda name: Path(tmp) / name
            envs = []

            def sh(cmd, *a, env=None, **k):
                counted = env.get("MLX_LFM_COUNT_STEP_NODES") == "1"
                envs.append((env.get("MLX_LFM_SYNC_STEPS"), counted))
                j = {"median_step_ms": 2.0, "solo_step_ms": 1.0, "batch_build_dispatch_sync_accept_us": [1, 2, 0, 3]}
                if counted:
                    j["batch_step_nodes"] = {"steps": 63, "min": 220, "mean": 260.0, "max": 2700}
                return Result(json.dumps(j) + "\n")

            run.sh = sh
            saved = {k: os.environ.pop(k, None) for k in ("H200_MODELS", "H200_BATCH_NODES_ONLY")}
            os.environ["H200_MODELS"] = "lfm2-350m-bf16"
            try:
                run.batch_phases()
                self.assertEqual(envs, [("0", False), ("1", False), ("0", False), ("1", False), (None, True)])
                got = [r for r in records(run) if r.get("engine") == "batch-phases"]
                self.assertEqual([r.get("sync") for r in got], [False, True, False, True, None])
                self.assertEqual(got[-1]["nodes"]["min"], 220)
                envs.clear()
                os.environ["H200_BATCH_NODES_ONLY"] = "1"
                run.batch_phases()
                self.assertEqual(envs, [(None, True)])
            finally:
                for k, v in saved.items():
                    os.environ.pop(k, None)
                    if v is not None:
                        os.environ[k] = v


class ColdPass(unittest.TestCase):
    """The untimed pass at a new prompt length is kept as its own metric,
    and only where the engine reported one."""

    def test_the_cold_pass_is_its_own_metric(self):
        with tempfile.TemporaryDirectory() as tmp:
            run = load_run(Path(tmp))
            run.record_cold("mlx-lfm", "lfm2-1.2b-bf16", 1, 512, 5252.0)
            run.record_cold("mlx-lm", "lfm2-1.2b-bf16", 1, 512, None)
            got = [r for r in records(run) if r.get("metric") == "prefill_cold_tps"]
            self.assertEqual(len(got), 1)
            self.assertEqual((got[0]["engine"], got[0]["prompt"], got[0]["samples"]), ("mlx-lfm", 512, [5252.0]))


class ShapeCost(unittest.TestCase):
    """`shape-cost` keeps each kind's line from the bench, nothing else."""

    def test_each_kind_is_recorded(self):
        with tempfile.TemporaryDirectory() as tmp:
            run = load_run(Path(tmp))
            lines = [{"shape_cost": "attention_causal", "from": 513, "new_ms": [60.0], "seen_ms": [1.0], "backend": "cuda"},
                     {"shape_cost": "matmul", "from": 577, "new_ms": [2.0], "seen_ms": [0.5], "backend": "cuda"}]
            out = "\n".join(json.dumps(l) for l in lines) + "\nmlx-lfm-bench: a note\n"
            run.sh = lambda *a, **k: Result(out)
            run.shape_cost()
            got = [r for r in records(run) if r.get("engine") == "shape-cost"]
            self.assertEqual([r["shape_cost"] for r in got], ["attention_causal", "matmul"])
            self.assertEqual(got[0]["new_ms"], [60.0])


class NewLengths(unittest.TestCase):
    """`new-lengths` times the defaults and the attention's buckets off, a
    process each, the switch in that process's environment only."""

    def test_both_arms_are_recorded(self):
        with tempfile.TemporaryDirectory() as tmp:
            run = load_run(Path(tmp))
            run.ours_ck = lambda name: Path(tmp) / name
            envs = []

            def sh(cmd, *a, **k):
                envs.append(k.get("env", {}).get("MLX_LFM_ATTENTION_BUCKET"))
                return Result(json.dumps({"new_lengths": 8, "median_new_ms": 90.0, "median_seen_ms": 5.0}) + "\n")

            run.sh = sh
            os.environ["H200_MODELS"] = "lfm2-1.2b-bf16"
            try:
                run.new_lengths()
            finally:
                os.environ.pop("H200_MODELS", None)
            got = [(r["model"], r["variant"]) for r in records(run) if r.get("engine") == "new-lengths"]
            self.assertEqual(got, [("lfm2-1.2b-bf16", "defaults"), ("lfm2-1.2b-bf16", "attention-bucket-off")])
            self.assertEqual(envs, [None, "0"])


class PerProcessSwitch(unittest.TestCase):
    """A switch read when a process builds its kernels (kernel-text-inline's
    MLX_LFM_KERNEL_TEXT) is timed as processes in alternation with the
    defaults, never as an engine of the defaults' process."""

    def test_kernel_text_inline_runs_as_processes(self):
        with tempfile.TemporaryDirectory() as tmp:
            run = load_run(Path(tmp))
            run.ours_ck = lambda name: Path(tmp) / name
            calls = []

            def sh(cmd, *a, **k):
                calls.append((cmd, k.get("env", {}).get("MLX_LFM_KERNEL_TEXT")))
                row = {"prompt": 512, "prefill_tps_runs": [1.0, 1.0], "decode_tps_runs": [2.0, 2.0],
                       "host_build_dispatch_wait_us_runs": [[1.0, 1.0, 1.0, 0.0]] * 2}
                return Result(json.dumps(row) + "\n")

            run.sh = sh
            os.environ.update(H200_MODELS="lfm2-1.2b-bf16", H200_AB_VARIANTS="kernel-text-inline", H200_AB_REPS="2")
            try:
                run.ab()
            finally:
                for k in ("H200_MODELS", "H200_AB_VARIANTS", "H200_AB_REPS"):
                    os.environ.pop(k, None)
            self.assertFalse([c for c, _ in calls if "--ab" in c], "an in-process --ab run")
            self.assertEqual(sorted({e for _, e in calls}, key=str), [None, "inline"])
            # (An opt-out: the path every session before 39 ran by default.)
            self.assertEqual(run.AB_TESTS["kernel-text-inline"], [])


def listing_of(names):
    """The test binary's `--list` of `names`."""
    return "".join(n + ": test\n" for n in names)


class FakeTestProcess:
    """A test process for run.kernels(): writes output(names) into the
    files it was given, as the test binary does while it runs."""

    def __init__(self, cmd, stdout=None, stderr=None, env=None, **_):
        self.env = env
        self.returncode = 0
        self.pid = id(self)
        out, err = self.output([c for c in cmd if "::" in c])
        stdout.write(out)
        stderr.write(err)

    # output() may leave returncode None: still running when the call's
    # TERM comes, so wait() raises what run.py's TERM handler raises
    # (`stopped`, set to the loaded run.Stopped by such a process).
    stopped = None

    def output(self, names):
        return "", ""

    def still_running(self, err=""):
        """output()'s answer for a process the TERM finds running."""
        self.returncode = None
        return "running 1 test\n", err

    def wait(self):
        if self.returncode is None:
            raise self.stopped("stopped by SIGTERM")
        return self.returncode

    def poll(self):
        return self.returncode

    def kill(self):
        self.returncode = -9


def passing_process(seen):
    """A FakeTestProcess class whose tests all pass, each process's test
    names appended to `seen`."""
    class Proc(FakeTestProcess):
        def output(self, names):
            seen.append(names)
            return "".join(f"test {n} ... ok\n" for n in names), ""
    return Proc


class KernelTests(unittest.TestCase):
    """The kernel tests' processes: the MLX_LFM_QINT tests each alone (their
    switch is read once a process), and one that found kernels built before
    it fails alone instead of reading as a GPU-less run (session 37: the
    whole call ran with the kernels off)."""

    CONV = "kernels::tests::conv_fused_kernel_matches_stock_ops"
    FFN = "kernels::tests::ffn_fused_kernel_matches_stock_ops"
    QKV = "kernels::tests::qkv_fused_kernel_matches_stock_ops"
    GREEDY = "kernels::tests::greedy_tokens_with_kernels_equal_stock_ops"
    GREEDY_MOE = GREEDY + "_on_moe"
    GREEDY_WIDE_MOE = GREEDY + "_on_wide_moe"
    PREFILL = "compiled::tests::compiled_prefill_equals_the_eager_prefill"

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.run = load_run(Path(self.tmp.name))

    def tearDown(self):
        self.tmp.cleanup()

    NAMES = ["kernels::tests::conv_fused_kernel_matches_stock_ops", "kernels::tests::q_by_conversion_conv_layer_matches_stock_ops",
             "kernels::tests::q_by_its_bits_gemv_matches_stock_ops", "kernels::tests::ffn_fused_kernel_matches_stock_ops",
             "kernels::tests::greedy_tokens_with_kernels_equal_stock_ops_on_moe", "kernels::tests::moe_fused_kernel_matches_the_three_kernels",
             "compiled::tests::compiled_prefill_equals_the_eager_prefill"]

    def committed(self, name, verdicts):
        """A committed raw file `name` under this test's root holding one
        tests record of `verdicts` (full test names to verdicts)."""
        results = Path(self.tmp.name) / "bench" / "results"
        results.mkdir(parents=True, exist_ok=True)
        got = {n.rsplit("::", 1)[-1]: v for n, v in verdicts.items()}
        (results / name).write_text(json.dumps({"engine": "tests", "verdicts": got}) + "\n")

    def run_kernels(self, proc, listing, tests):
        """run.kernels() over a test binary listing `listing`, its processes
        made by `proc`, with H200_KERNEL_TESTS=`tests`."""
        run = self.run
        run.sh = lambda cmd, **k: Result(listing)
        run.subprocess = type("S", (), {"Popen": proc, "PIPE": None})
        run.TESTS = Path(self.tmp.name) / "tests"
        run.TESTS.mkdir(exist_ok=True)
        (run.TESTS / "mlx_lfm-0").write_text("")
        real_root = run.ROOT
        run.ROOT = Path(self.tmp.name)
        os.environ["H200_KERNEL_TESTS"] = tests
        try:
            run.kernels()
        finally:
            os.environ.pop("H200_KERNEL_TESTS")
            run.ROOT = real_root

    def test_a_gzipped_test_binary_is_unpacked_and_preferred(self):
        import gzip

        run = self.run
        real_root, real_tests = run.ROOT, run.TESTS
        run.ROOT, run.TESTS = Path(self.tmp.name), Path(self.tmp.name) / "work-tests"
        try:
            carried = run.ROOT / ".device" / "tests"
            carried.mkdir(parents=True)
            (carried / "mlx_lfm-old").write_text("an older plain build")
            with gzip.open(carried / "mlx_lfm-new.gz", "wb") as f:
                f.write(b"the new build")
            got = run.test_binary()
            self.assertEqual(got, run.TESTS / "mlx_lfm-new")
            self.assertEqual(got.read_bytes(), b"the new build")
            self.assertTrue(os.access(got, os.X_OK), "the unpacked binary must be executable")
            (carried / "mlx_lfm-new.gz").unlink()
            self.assertEqual(run.test_binary(), carried / "mlx_lfm-old", "a plain binary alone is used as it is")
        finally:
            run.ROOT, run.TESTS = real_root, real_tests

    def test_each_qint_test_has_a_process(self):
        for jobs in (1, 2, 4):
            groups, exact = self.run.test_processes(self.NAMES, jobs)
            self.assertEqual(exact, ["compiled::tests::compiled_prefill_equals_the_eager_prefill"])
            for n in self.NAMES[1:3]:
                self.assertIn([n], groups, f"jobs {jobs}")
            ran = sorted(n for g in groups for n in g)
            self.assertEqual(ran, sorted(self.NAMES[:-1]), f"jobs {jobs}: each test once")
        groups, _ = self.run.test_processes(self.NAMES, 4)
        self.assertIn(["kernels::tests::greedy_tokens_with_kernels_equal_stock_ops_on_moe"], groups)

    def test_committed_raw_files_run_in_session_order(self):
        names = [Path(p).name for p in self.run.committed_raw_files()]
        for before, after in [("2026-12-05-h200-session30.raw.jsonl", "2026-12-05-h100-session31.raw.jsonl"),
                              ("2026-12-03-h200-session18.raw.jsonl", "2026-12-03-h200-session18b.raw.jsonl"),
                              ("2026-12-02-h200-session9.raw.jsonl", "2026-12-02-h200-session10.raw.jsonl")]:
            self.assertLess(names.index(before), names.index(after))

    def test_a_gpu_test_no_session_judged_runs_alone(self):
        """Session 52's new test sat in the process of ~40 others, which
        libtest runs by name, and never started before the call's TERM."""
        run = self.run
        self.committed("2026-12-05-h200-session30.raw.jsonl", {self.CONV: True, self.FFN: True})
        new_gpu = "kernels::tests::moe_fused_gate_rows_match_the_exact_form"
        new_cpu = "kernels::moe_fused::tests::a_launch_counts_its_parts"
        names = [self.CONV, self.FFN, new_gpu, new_cpu, self.GREEDY_MOE, self.PREFILL]
        real_root = run.ROOT
        run.ROOT = Path(self.tmp.name)
        try:
            # (The greedy sets and the compiled prefill have processes of
            # their own already.)
            self.assertEqual(run.never_judged(names), [new_gpu, self.GREEDY_MOE, self.PREFILL])
        finally:
            run.ROOT = real_root
        seen = []
        Proc = passing_process(seen)
        os.environ["H200_KERNEL_PARTS"] = ""
        os.environ["H200_KERNEL_JOBS"] = "3"
        try:
            self.run_kernels(Proc, listing_of(names), "kernels::,compiled_prefill")
        finally:
            os.environ.pop("H200_KERNEL_PARTS")
            os.environ.pop("H200_KERNEL_JOBS")
        self.assertIn([new_gpu], seen)
        self.assertNotIn([new_cpu], seen, "a module's CPU test keeps to the shared process")
        # The greedy set's, two shared by the rest (the new test's process
        # takes none of H200_KERNEL_JOBS's three), the new test's, the
        # compiled prefill's.
        self.assertEqual(len(seen), 5, seen)
        self.assertEqual(sorted(n for g in seen for n in g), sorted(names), "each test once")

    def test_unpassed_runs_what_a_session_did_not_pass_until_none_is_left(self):
        run = self.run
        self.committed("2026-12-07-h100-session52.raw.jsonl", {self.CONV: True, self.FFN: False})
        names = [self.CONV, self.FFN, self.QKV]
        seen = []
        Proc = passing_process(seen)
        os.environ["H200_KERNEL_PARTS"] = ""
        try:
            chosen = "unpassed:bench/results/2026-12-07-h100-session52.raw.jsonl"
            self.run_kernels(Proc, listing_of(names), chosen)
            first = [n for g in seen for n in g]
            self.run_kernels(Proc, listing_of(names), chosen)
        finally:
            os.environ.pop("H200_KERNEL_PARTS")
        self.assertEqual(sorted(first), sorted([self.FFN, self.QKV]), "the failed and the unreached, not the passed")
        self.assertEqual([n for g in seen for n in g], first, "the second call finds none left")

    def test_a_later_verdict_replaces_an_earlier_for_unpassed(self):
        results = Path(self.tmp.name) / "bench" / "results"
        results.mkdir(parents=True)
        rec = lambda v: json.dumps({"engine": "tests", "verdicts": v}) + "\n"
        (results / "a.raw.jsonl").write_text(rec({"conv": True, "ffn": False}) + rec({"conv": False}))
        (results / "b.raw.jsonl").write_text(rec({"ffn": True}))
        real_root = self.run.ROOT
        self.run.ROOT = Path(self.tmp.name)
        try:
            self.assertEqual(self.run.passed_in(["bench/results/a.raw.jsonl"]), set())
            self.assertEqual(self.run.passed_in(["bench/results/a.raw.jsonl", "bench/results/b.raw.jsonl"]), {"ffn"})
        finally:
            self.run.ROOT = real_root

    def test_every_test_that_narrows_its_cases_is_in_narrowed_tests(self):
        """A test whose cases case_chosen picks (itself or through a helper)
        speaks for its chosen cases only under MLX_LFM_TEST_CASES: its
        verdict of such a run must not stand for the whole test (session
        52's review: the MoE layer's default test had joined them unnamed)."""
        src = (HERE.parents[1] / "src" / "kernels" / "tests.rs").read_text()
        starts = [(m.start(), m.group(1)) for m in re.finditer(r"^(?:pub(?:\(crate\))? )?fn (\w+)", src, re.M)]
        bodies = {n: src[a:b] for (a, n), (b, _) in zip(starts, starts[1:] + [(len(src), None)])}
        # The functions that pick cases, and every one that calls one of
        # them, to any depth.
        picking = {n for n, b in bodies.items() if "case_chosen(" in b and n not in ("case_chosen", "case_chosen_by")}
        while True:
            more = {n for n, b in bodies.items() if n not in picking and any(re.search(rf"\b{h}\(", b) for h in picking)}
            if not more:
                break
            picking |= more
        tests = set(re.findall(r"^#\[test\]\n(?:pub )?fn (\w+)", src, re.M))
        # (And the qint_tests! macro's tests, each running a test's body:
        # `name: "value", switch, body;`.)
        macro = dict(re.findall(r"^\s*(q_by_\w+): \"\w+\", [\w:]+, (\w+);", src, re.M))
        self.assertGreaterEqual(len(macro), 10, "the qint_tests! lines were not found")
        narrowing = (tests & picking) | {t for t, body in macro.items() if body in picking}
        self.assertGreaterEqual(len(narrowing), 13)
        self.assertEqual(narrowing, set(self.run.NARROWED_TESTS))

    def test_a_qint_test_that_could_not_run_fails_alone(self):
        run = self.run
        listing = "".join(n + ": test\n" for n in self.NAMES[:3])

        class Proc(FakeTestProcess):
            def output(self, names):
                out = "".join(f"test {n} ... ok\n" for n in names)
                err = "".join(f"skipped {n.rsplit('::', 1)[-1]}: kernels were built without MLX_LFM_QINT=convert earlier "
                              "in this process; run it alone\n" for n in names if "q_by_conversion" in n)
                return out, err

        self.run_kernels(Proc, listing, "conv_fused,q_by_conversion,q_by_its_bits")
        rec = [r for r in records(run) if r["engine"] == "tests"][-1]
        self.assertFalse(rec["skipped"])
        self.assertFalse(rec["verdicts"]["q_by_conversion_conv_layer_matches_stock_ops"])
        self.assertTrue(rec["verdicts"]["conv_fused_kernel_matches_stock_ops"])
        self.assertTrue(rec["verdicts"]["q_by_its_bits_gemv_matches_stock_ops"])
        self.assertFalse((run.WORK / "kernels-off").exists(), "a default kernel's verdict stood")

    def test_a_kernels_off_file_does_not_reach_the_tests(self):
        run = self.run
        listing = "kernels::tests::conv_fused_kernel_matches_stock_ops: test\n"
        envs = []

        class Proc(FakeTestProcess):
            def output(self, names):
                envs.append(self.env)
                return "test kernels::tests::conv_fused_kernel_matches_stock_ops ... ok\n", ""

        run.WORK.mkdir(parents=True, exist_ok=True)
        (run.WORK / "kernels-off").write_text("1")
        self.assertEqual(run.env().get("MLX_LFM_KERNELS"), "0", "the benchmarks' environment keeps the file's word")
        self.run_kernels(Proc, listing, "conv_fused")
        self.assertTrue(envs)
        self.assertTrue(all("MLX_LFM_KERNELS" not in e for e in envs), "the tests ran with the kernels off")

    def test_a_greedy_set_failed_on_one_fixture_fails(self):
        """Session 49: the MoE fixture's float32-sum sets FAILED, and the
        wide fixture's process, read after it, wrote its passes over them."""
        run = self.run
        names = [self.GREEDY_MOE, self.GREEDY_WIDE_MOE]
        listing = listing_of(names)

        class Proc(FakeTestProcess):
            def output(self, names):
                word = "passed" if any("wide" in n for n in names) else "FAILED"
                return "", f"TinyMoe: the qgemv-float kernels {word} after near-ties: []\nTinyMoe: the default kernels passed\n"

        self.run_kernels(Proc, listing, "greedy_tokens")
        rec = [r for r in records(run) if r["engine"] == "tests"][-1]
        self.assertFalse(rec["verdicts"]["greedy:qgemv-float"])
        self.assertTrue(rec["verdicts"]["greedy:default"])

    def test_processes_sharing_the_gpu_hold_their_cache(self):
        """Several test processes each get MLX_LFM_TEST_CACHE_LIMIT_MB
        (session 53: fourteen ran an H100 out of memory); a process alone
        keeps MLX's own cache."""
        limits = []

        class Proc(FakeTestProcess):
            def output(self, names):
                limits.append(self.env.get("MLX_LFM_TEST_CACHE_LIMIT_MB"))
                return "".join(f"test {n} ... ok\n" for n in names), ""

        names = [self.FFN, self.QKV, self.CONV]
        os.environ["H200_KERNEL_JOBS"] = "3"
        try:
            self.run_kernels(Proc, listing_of(names), "fused")
        finally:
            os.environ.pop("H200_KERNEL_JOBS")
        self.assertGreater(len(limits), 1)
        self.assertEqual(set(limits), {str(self.run.TEST_CACHE_LIMIT_MB)})
        limits.clear()
        os.environ["H200_KERNEL_JOBS"] = "1"
        try:
            self.run_kernels(Proc, listing_of([self.QKV]), "qkv_fused")
        finally:
            os.environ.pop("H200_KERNEL_JOBS")
        self.assertEqual(limits, [None])

    def test_a_long_test_runs_in_parts(self):
        """The feed-forward's test as n processes, MLX_LFM_TEST_PART=i/n
        each: its verdict is every part's, and only once all finished."""
        run = self.run
        names = [self.FFN, self.QKV]
        listing = listing_of(names)
        seen = []

        def proc(fail_part=None, cut_part=None):
            class Proc(FakeTestProcess):
                def output(self, names):
                    part = self.env.get("MLX_LFM_TEST_PART")
                    seen.append((tuple(names), part))
                    if cut_part is not None and part == cut_part:
                        return self.still_running()
                    word = "FAILED" if part == fail_part else "ok"
                    return "".join(f"test {n} ... {word}\n" for n in names), ""
            Proc.stopped = run.Stopped
            return Proc

        os.environ["H200_KERNEL_PARTS"] = "ffn_fused_kernel_matches_stock_ops=3"
        try:
            self.run_kernels(proc(), listing, "ffn_fused,qkv_fused")
            self.assertEqual(sorted(p for n, p in seen if "ffn" in n[0]), ["0/3", "1/3", "2/3"])
            self.assertEqual([p for n, p in seen if "qkv" in n[0]], [None], "a test not listed runs whole")
            rec = [r for r in records(run) if r["engine"] == "tests"][-1]
            self.assertTrue(rec["verdicts"]["ffn_fused_kernel_matches_stock_ops"])
            self.assertEqual(rec["parts"], {"ffn_fused_kernel_matches_stock_ops": ["0/3", "1/3", "2/3"]})

            self.run_kernels(proc(fail_part="1/3"), listing, "ffn_fused")
            rec = [r for r in records(run) if r["engine"] == "tests"][-1]
            self.assertFalse(rec["verdicts"]["ffn_fused_kernel_matches_stock_ops"], "one part failed")

            with self.assertRaises(run.Stopped):
                self.run_kernels(proc(cut_part="2/3"), listing, "ffn_fused")
            rec = [r for r in records(run) if r["engine"] == "tests"][-1]
            self.assertNotIn("ffn_fused_kernel_matches_stock_ops", rec["verdicts"], "two parts of three are no verdict")

            os.environ["H200_KERNEL_PARTS"] = "ffn_fused_kernel_matches_stock_ops=0"
            with self.assertRaises(SystemExit):
                run.kernel_test_parts()
        finally:
            os.environ.pop("H200_KERNEL_PARTS")

    def test_reused_verdicts_of_other_kernel_code_are_named(self):
        run = self.run
        real_root = run.ROOT
        run.ROOT = Path(self.tmp.name)
        (run.ROOT / "r").mkdir()
        old = {"engine": "tests", "verdicts": {"decode_attention_kernel_matches_stock_ops": True,
                                               "conv_fused_kernel_matches_stock_ops": False},
               "sources": {"src/kernels/stages.rs": "old"}}
        new = {"engine": "tests", "verdicts": {"conv_fused_kernel_matches_stock_ops": True},
               "sources": {"src/kernels/stages.rs": "now"}}
        (run.ROOT / "r" / "a.raw.jsonl").write_text(json.dumps(old) + "\n")
        (run.ROOT / "r" / "b.raw.jsonl").write_text(json.dumps(new) + "\n")
        run.kernel_sources = lambda: {"src/kernels/stages.rs": "now"}
        os.environ["H200_KERNEL_TESTS"] = "_"
        try:
            run.verdicts_from("r/a.raw.jsonl,r/b.raw.jsonl")
        finally:
            os.environ.pop("H200_KERNEL_TESTS")
            run.ROOT = real_root
        rec = [r for r in records(run) if r["engine"] == "tests-reused"][-1]
        self.assertEqual(rec["stale"], ["decode_attention_kernel_matches_stock_ops"])
        self.assertTrue(rec["verdicts"]["conv_fused_kernel_matches_stock_ops"], "the later verdict stands")

    def test_unrun_runs_what_an_earlier_call_did_not_finish(self):
        run = self.run
        names = [self.CONV, self.FFN, self.PREFILL]
        listing = listing_of(names)
        seen = []

        class Proc(FakeTestProcess):
            def output(self, names):
                seen.append(names)
                if any("ffn" in n for n in names) and len(seen) <= 3:
                    return self.still_running()
                return "".join(f"test {n} ... ok\n" for n in names), ""
        Proc.stopped = run.Stopped
        os.environ["H200_KERNEL_PARTS"] = ""
        try:
            with self.assertRaises(run.Stopped):
                self.run_kernels(Proc, listing, "conv_fused,ffn_fused,compiled_prefill")
            first = len(seen)
            self.run_kernels(Proc, listing, "unrun")
        finally:
            os.environ.pop("H200_KERNEL_PARTS")
        self.assertEqual([n for g in seen[first:] for n in g], [self.FFN])
        ran = json.loads((run.WORK / "kernel-ran.json").read_text())
        self.assertEqual(sorted(ran), ["compiled_prefill_equals_the_eager_prefill", "conv_fused_kernel_matches_stock_ops",
                                       "ffn_fused_kernel_matches_stock_ops"])

    def test_a_greedy_process_ended_by_a_signal_gives_its_failures_only(self):
        """`timeout` sends its TERM to the whole group: a greedy process
        may have died of it before run.py's handler looks, its passes on
        some fixtures only; a FAILED line is a failure wherever it comes."""
        run = self.run
        names = [self.GREEDY_MOE, self.GREEDY_WIDE_MOE]
        listing = listing_of(names)

        class Proc(FakeTestProcess):
            def output(self, names):
                if any("wide" in n for n in names):
                    self.returncode = -15
                    return "running 1 test\n", "W: the qgemv-float kernels passed\nW: the moe-float kernels FAILED\n"
                return "".join(f"test {n} ... ok\n" for n in names), "M: the default kernels passed\n"
        self.run_kernels(Proc, listing, "greedy_tokens")
        rec = [r for r in records(run) if r["engine"] == "tests"][-1]
        self.assertNotIn("greedy:qgemv-float", rec["verdicts"])
        self.assertFalse(rec["verdicts"]["greedy:moe-float"])
        self.assertTrue(rec["verdicts"]["greedy:default"])
        self.assertNotIn("greedy_tokens_with_kernels_equal_stock_ops_on_wide_moe", rec["verdicts"])

    def test_unrun_keeps_a_greedy_set_failed_on_an_earlier_fixture(self):
        run = self.run
        names = [self.GREEDY_MOE, self.GREEDY_WIDE_MOE]
        listing = listing_of(names)
        calls = []

        class Proc(FakeTestProcess):
            def output(self, names):
                calls.append(names)
                if any("wide" in n for n in names) and len(calls) <= 2:
                    return self.still_running()
                word = "passed" if any("wide" in n for n in names) else "FAILED"
                ok = "ok" if word == "passed" else "FAILED"
                return "".join(f"test {n} ... {ok}\n" for n in names), f"X: the qgemv-float kernels {word}\n"
        Proc.stopped = run.Stopped
        with self.assertRaises(run.Stopped):
            self.run_kernels(Proc, listing, "greedy_tokens")
        self.run_kernels(Proc, listing, "unrun")
        rec = [r for r in records(run) if r["engine"] == "tests"][-1]
        self.assertEqual([n for g in calls[2:] for n in g], [names[1]], "only the cut fixture ran again")
        self.assertFalse(rec["verdicts"]["greedy:qgemv-float"], "the earlier fixture's FAILED stands")
        self.assertFalse(json.loads((run.WORK / "kernel-verdicts.json").read_text())["greedy:qgemv-float"])

    def test_a_narrowed_run_speaks_for_its_cases_only(self):
        r = {"engine": "tests", "cases": "Bfloat16 2048", "verdicts": {"decode_attention_kernel_matches_stock_ops": True,
                                                                         "ffn_fused_kernel_matches_stock_ops": True,
                                                                         "gemv_kernel_matches_stock_ops": True}}
        self.assertEqual(self.run.record_verdicts(r), {"gemv_kernel_matches_stock_ops": True})

    def test_a_cut_call_records_the_finished_tests(self):
        """Session 48's test call was cut at its TERM with nothing recorded:
        the finished processes' verdicts stand, a killed greedy process's
        sets do not, and the call still stops."""
        run = self.run
        names = [self.CONV, self.FFN, self.GREEDY]
        listing = listing_of(names)
        procs = []

        class Proc(FakeTestProcess):
            def output(self, names):
                procs.append(self)
                if any("greedy" in n for n in names):
                    # Still running when the TERM comes: one fixture's line only.
                    return self.still_running("TinyBF16: the default kernels passed\n")
                if any("ffn" in n for n in names):
                    return self.still_running()
                return "".join(f"test {n} ... ok\n" for n in names), ""
        Proc.stopped = run.Stopped

        with self.assertRaises(run.Stopped):
            self.run_kernels(Proc, listing, "conv_fused,ffn_fused,greedy_tokens")
        rec = [r for r in records(run) if r["engine"] == "tests"][-1]
        self.assertTrue(rec["cut"])
        self.assertFalse(rec["passed"])
        self.assertEqual(rec["verdicts"], {"conv_fused_kernel_matches_stock_ops": True})
        self.assertTrue(all(p.returncode is not None for p in procs), "every process was ended")
        self.assertIn("TinyBF16", (run.OUT / "kernel-tests.log").read_text(), "the cut process's output is kept")


    def test_the_group_copy_of_the_term_does_not_cut_the_record(self):
        """`timeout` sends its TERM to run.py, then to its process group:
        session 52's call took the second inside the first's wrap-up and
        recorded nothing of the tests it had finished."""
        run = self.run
        names = [self.CONV, self.FFN]
        listing = listing_of(names)

        class Proc(FakeTestProcess):
            def output(self, names):
                if any("ffn" in n for n in names):
                    return self.still_running()
                return "".join(f"test {n} ... ok\n" for n in names), ""

            def wait(self):
                if self.returncode is None:
                    run.on_sigterm(15, None)  # the TERM to run.py
                return self.returncode

            def kill(self):
                run.on_sigterm(15, None)  # its copy to the group, in the wrap-up
                self.returncode = -15
        with self.assertRaises(run.Stopped):
            self.run_kernels(Proc, listing, "conv_fused,ffn_fused")
        rec = [r for r in records(run) if r["engine"] == "tests"][-1]
        self.assertTrue(rec["cut"])
        self.assertEqual(rec["verdicts"], {"conv_fused_kernel_matches_stock_ops": True})



class AbPrompt(unittest.TestCase):
    """H200_AB_PROMPT sets the A/B's prompt, range-checked, and `pick` takes
    no switch from an A/B at another depth than the targets' 512."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.run = load_run(Path(self.tmp.name))

    def tearDown(self):
        os.environ.pop("H200_AB_PROMPT", None)
        self.tmp.cleanup()

    def test_the_prompt_is_checked(self):
        self.assertEqual(self.run.ab_prompt(), 512)
        os.environ["H200_AB_PROMPT"] = "4096"
        self.assertEqual(self.run.ab_prompt(), 4096)
        for bad in ("0", "8", "40000", "2k", "-5"):
            os.environ["H200_AB_PROMPT"] = bad
            with self.assertRaises(SystemExit):
                self.run.ab_prompt()

    def ab_rows(self, prompt):
        for variant, decode in (("all", 100.0), ("kv-in-place", 110.0)):
            self.run.record(engine="ab", model="lfm2-1.2b-bf16", variant=variant, prompt=prompt,
                            prefill=[1000.0, 1000.0], decode=[decode] * 3, decode_ratio=[decode / 100.0] * 3,
                            prefill_ratio=[1.0] * 3, paired=True)

    def picked(self):
        (self.run.WORK / "kernel-verdicts.json").write_text(json.dumps({t: True for t in self.run.AB_TESTS["kv-in-place"]}))
        self.run.pick()
        return json.loads((self.run.WORK / "picked-env.json").read_text())

    def test_a_long_prompt_ab_is_not_picked_from(self):
        self.ab_rows(4096)
        self.assertNotIn("MLX_LFM_KV_IN_PLACE", self.picked())

    def test_the_targets_depth_is(self):
        self.ab_rows(512)
        self.assertEqual(self.picked().get("MLX_LFM_KV_IN_PLACE"), "1")


class AbTables(unittest.TestCase):
    """The A/B tables name what exists: every variant `pick` reads or
    DECODE_ONLY lists is in AB, every variant AB_TESTS gates is, every
    test it needs is a test of the suite, and every greedy set it needs is
    one the greedy test prints (a set renamed or dropped in tests.rs would
    leave a variant unpickable, or gated by nothing)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.run = load_run(Path(self.tmp.name))
        self.tests_rs = (HERE.parents[1] / "src" / "kernels" / "tests.rs").read_text()

    def tearDown(self):
        self.tmp.cleanup()

    def test_every_named_variant_exists(self):
        picked = {v for group, _ in self.run.PICK for v in group}
        for name in sorted(picked | set(self.run.DECODE_ONLY) | set(self.run.AB_TESTS)):
            self.assertTrue(name in self.run.AB, f"{name}: not an A/B variant")

    def test_every_needed_test_and_greedy_set_exists(self):
        import re
        # (Test functions anywhere in src/, and the ones tests.rs's macro
        # makes, one `name: ...;` line each.)
        src = "".join(f.read_text() for f in (HERE.parents[1] / "src").rglob("*.rs"))
        tests = set(re.findall(r"fn (\w+)\(\)", src)) | set(re.findall(r"(?m)^\s*(\w+): \"", self.tests_rs))
        literals = set(re.findall(r'"([\w.:-]+)"', self.tests_rs))
        for variant, needs in self.run.AB_TESTS.items():
            for need in needs:
                if need.startswith("greedy:"):
                    # ("default" is the greedy test's first run.)
                    self.assertTrue(need[len("greedy:"):] in literals, f"{variant}: {need} is no set tests.rs runs")
                else:
                    self.assertTrue(need in tests, f"{variant}: {need} is no test in src/")

    def test_every_norm_off_turns_all_three_off(self):
        self.assertEqual(self.run.AB["every-norm-off"][0], self.run.EVERY_NORM_OFF)
        self.assertEqual(set(self.run.EVERY_NORM_OFF.values()), {"0"})
        for var in self.run.EVERY_NORM_OFF:
            self.assertIn(var, self.tests_rs)


if __name__ == "__main__":
    unittest.main(verbosity=2)
