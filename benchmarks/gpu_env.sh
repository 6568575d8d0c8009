# Sourced by the GPU scripts (gpu_check.sh, session_check.sh) from the repository root: installs the wheels in
# .whl/ (e.g. fla-core, for the comparison; the device machine has no network) to /tmp/site and puts them and
# the repository on PYTHONPATH.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
