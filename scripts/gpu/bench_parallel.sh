#!/usr/bin/env bash
# Usage (on a two-GPU device, under run_kit.sh --te /tmp/te): scripts/gpu/bench_parallel.sh GROUP...
#   GROUP: dp (data parallel 2), tp (tensor parallel 2), pp (pipeline parallel 2, 2 virtual stages),
#   full (fully_reshardable save and resumes), async (async_save and resumes)
# Issue 25's runs (docs/benchmarks.md#issue25-plan): per group a fresh run without and with offload (the
# latter saving every 4 iterations), then both resumes from iteration 4. A run is skipped when fewer than
# MIN_S seconds remain before DEADLINE_S (a device call's limit) or when its JSON exists (a later call on
# the same machine goes on where the last stopped). Ends with summary.txt: each rank's peaks, step and
# hash, and each pair's bit-identity. Results and logs in /tmp/i25, a tar of them in $OUT.
set -u
DEADLINE_S=${DEADLINE_S:-540}
MIN_S=${MIN_S:-75}
R=/tmp/i25; CK=/tmp/i25ck; mkdir -p $R $CK
start=$SECONDS
T="torchrun --standalone --nproc-per-node 2 scripts/bench_offload.py run --optimizer te --iters 8"
F="python3 -m bridge_fgo.cli.launcher --offload builtin --chunk-mb 256"
run() {  # run NAME CMD...
  local name=$1; shift
  if [[ -f $R/$name.json ]]; then echo "DONE $name"; return; fi
  local left=$((DEADLINE_S - (SECONDS - start)))
  if [[ $left -lt $MIN_S ]]; then echo "SKIP $name ($left s left)"; return; fi
  local t0=$SECONDS
  timeout $((left - 20)) "$@" --out $R/$name.json > $R/$name.log 2>&1
  echo "RUN $name rc=$? $((SECONDS - t0)) s"
}
group() {  # group TAG EXTRA...
  local tag=$1; shift
  run ${tag}_fresh_base $T --mode base "$@"
  run ${tag}_fresh_builtin $F $T --mode builtin --chunk-mb 256 --save $CK/$tag --save-interval 4 "$@"
  run ${tag}_resume_base $T --mode base --load $CK/$tag --ckpt-step 4 "$@"
  run ${tag}_resume_builtin $F $T --mode builtin --chunk-mb 256 --load $CK/$tag --ckpt-step 4 "$@"
  rm -rf $CK/$tag
}
for g in "$@"; do
  case $g in
    dp) group dp2 ;;
    tp) group tp2 --tp 2 ;;
    pp) group pp2vpp2 --pp 2 --vpp 2 ;;
    full)
      run full_fresh_builtin $F $T --mode builtin --chunk-mb 256 --fully-reshardable --save $CK/full --save-interval 4
      run full_resume_base $T --mode base --load $CK/full --ckpt-step 4
      run full_resume_builtin $F $T --mode builtin --chunk-mb 256 --load $CK/full --ckpt-step 4
      rm -rf $CK/full ;;
    async)
      run async_fresh_builtin $F $T --mode builtin --chunk-mb 256 --async-save --save $CK/async --save-interval 4
      run async_resume_base $T --mode base --load $CK/async --ckpt-step 4
      run async_resume_builtin $F $T --mode builtin --chunk-mb 256 --load $CK/async --ckpt-step 4
      rm -rf $CK/async ;;
  esac
done
python3 - <<'EOF' | tee $R/summary.txt
import glob, json, os
R = "/tmp/i25"
def load(p):
    try:
        return json.load(open(p))["summary"]
    except Exception as e:
        return None
for p in sorted(glob.glob(f"{R}/*.json")):
    s = load(p)
    if not s:
        print(os.path.basename(p), "no summary"); continue
    run, steady = s.get("run_peak_gib"), s.get("steady_iter_peak_gib")
    within = run is not None and steady and run <= steady * 1.03
    print(f"{os.path.basename(p)}: run peak {run:.2f} GiB, steady {steady:.2f}, max iter {s.get('max_iter_peak_gib') or 0:.2f}, "
          f"resume {s.get('resume_peak_gib')}, within 3%: {within}, step {s.get('steady_step_median_s'):.3f} s, "
          f"host rss {s.get('host_peak_rss_gib')}, sha {str(s.get('final_params_sha256'))[:12]}, losses {s.get('losses')}")
for b in sorted(glob.glob(f"{R}/*_builtin*.json")):
    a = b.replace("_builtin", "_base")
    sb, sa = load(b), load(a)
    if sb and sa:
        print(f"PAIR {os.path.basename(a)} / {os.path.basename(b)}: losses identical {sa['losses'] == sb['losses']}, "
              f"params identical {sa['final_params_sha256'] == sb['final_params_sha256']}")
EOF
[[ -z "${OUT:-}" ]] || tar czf "$OUT/i25-$(date +%H%M).tgz" -C /tmp i25
