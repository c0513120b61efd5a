# Sourced by scripts/ray-tests.sh and scripts/torchrl-compat.sh: layered_venv TAG BASE VENV makes
# VENV a venv layered on BASE (BASE's site-packages a site directory of VENV, so that its .pth
# files, the editable install's among them, are read too; VENV's own packages come first), so that
# what BASE has (torch above all) is not installed a second time.
layered_venv() {
  local tag=$1 base=$2 venv=$3
  if [ ! -x "$base/bin/python" ]; then
    echo "[$tag] $base is not set up: run bash scripts/run.sh test (it sets it up and then runs this)" >&2
    return 1
  fi
  if [ ! -x "$venv/bin/python" ]; then
    echo "[$tag] creating $venv on top of $base"
    "$base/bin/python" -m venv "$venv"
  fi
  local base_site own_site
  base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  own_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  printf 'import site; site.addsitedir(%s)\n' "$("$base/bin/python" -c 'import sys; print(repr(sys.argv[1]))' "$base_site")" \
    >"$own_site/aiocollect-base-venv.pth"
}
