#!/usr/bin/env bash
# The package as a user receives it: build the sdist and the wheel (the wheel from the
# sdist, so a file missing from the sdist shows), install the wheel alone into a fresh venv
# outside the repository (base dependencies only, pinned by constraints.txt), and from a
# folder outside the repository list the envs and train a short CartPole run with the tuned
# config shipped in the wheel. Fails when any step fails or the run folder is incomplete.
#
#   BUILD_PYTHON  a python with `build` (default: the repository's .venv/bin/python)
#   PYTHON        the python the fresh venv is made from (default: python3)
#   KEEP=1        keep the temporary folder (printed) for a look afterwards
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_PYTHON="${BUILD_PYTHON:-$repo/.venv/bin/python}"
PYTHON="${PYTHON:-python3}"
STEPS=4096  # two iterations of the tuned CartPole config (16 envs x 128 steps)
work="$(mktemp -d "${TMPDIR:-/tmp}/jaxppo-wheel-check.XXXXXX")"
if [[ "${KEEP:-0}" == 1 ]]; then
    echo "temporary folder (kept): $work"
else
    trap 'rm -rf "$work"' EXIT
fi
start=$SECONDS

fail() {
    echo "wheel check FAILED: $*" >&2
    exit 1
}

step() {
    echo "== $* ($((SECONDS - start)) s)"
}

step "building the sdist and the wheel into $work/dist"
if ! "$BUILD_PYTHON" -m build --outdir "$work/dist" "$repo" >"$work/build.log" 2>&1; then
    tail -n 40 "$work/build.log" >&2
    fail "python -m build failed (is the dev extra installed? make install)"
fi
shopt -s nullglob
wheels=("$work"/dist/jaxppo-*.whl)
sdists=("$work"/dist/jaxppo-*.tar.gz)
shopt -u nullglob
[[ ${#wheels[@]} == 1 && ${#sdists[@]} == 1 ]] || fail "expected one wheel and one sdist in $work/dist"
wheel="${wheels[0]}"
echo "wheel $(basename "$wheel"): $(du -h "$wheel" | cut -f1); sdist $(basename "${sdists[0]}"): $(du -h "${sdists[0]}" | cut -f1)"
"$BUILD_PYTHON" - "$wheel" <<'EOF' || fail "the wheel lacks the tuned configs"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert "jaxppo/configs/CartPole-v1.yaml" in names, "jaxppo/configs/CartPole-v1.yaml"
EOF

step "installing the wheel alone into a fresh venv ($work/venv)"
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --upgrade pip
"$work/venv/bin/python" -m pip install --quiet -c "$repo/constraints.txt" "$wheel"
du -sh "$work/venv" | sed 's/^/venv size: /'

# From here on as a user: outside the repository, with a home of its own (the compilation
# cache goes to ~/.cache), nothing of the repository on the path.
mkdir -p "$work/user" "$work/home"
cd "$work/user"
as_user() {
    env -u PYTHONPATH -u VIRTUAL_ENV HOME="$work/home" "$@"
}
location="$(as_user "$work/venv/bin/python" -c 'import jaxppo; print(jaxppo.__file__)')"
[[ "$location" == "$work/venv/"* ]] || fail "jaxppo was imported from $location, not the venv"

step "jaxppo envs"
as_user "$work/venv/bin/jaxppo" envs >"$work/envs.txt" || { cat "$work/envs.txt"; fail "jaxppo envs"; }
grep -q "CartPole-v1" "$work/envs.txt" || { cat "$work/envs.txt"; fail "jaxppo envs does not list CartPole-v1"; }
echo "$(wc -l <"$work/envs.txt") lines, CartPole-v1 among them"

step "jaxppo train --env CartPole-v1 ($STEPS env steps)"
runs="$work/runs"
as_user "$work/venv/bin/jaxppo" train --env CartPole-v1 --runs-dir "$runs" --run-name wheel-check \
    --set total_timesteps=$STEPS 2>&1 | tee "$work/train.log"
grep -q "^config: defaults < tuned CartPole-v1 < --set" "$work/train.log" \
    || fail "the run did not use the tuned CartPole-v1 config shipped in the wheel"
run="$runs/wheel-check"
for f in config.yaml metrics.jsonl params.msgpack summary.json; do
    [[ -s "$run/$f" ]] || fail "$run/$f is missing or empty"
done
grep -q "^num_envs: 16$" "$run/config.yaml" || fail "config.yaml does not hold the tuned num_envs (16)"
iterations="$(wc -l <"$run/metrics.jsonl")"
[[ "$iterations" == 2 ]] || fail "metrics.jsonl has $iterations lines, expected 2 iterations"

echo "wheel check passed in $((SECONDS - start)) s"
