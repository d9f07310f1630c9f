#!/usr/bin/env bash
# Install the loaders users would pick instead of dimd, each into a venv of its own, for
# bench/peer_loaders.py (`make bench-peers`).
#
#   bench/peers/setup.sh [NAME...]      # default: every peer (ffcv litdata webdataset torchvision)
#
# Each peer goes to build/peers/NAME/ (a venv). A peer whose venv is installed with the same
# pins is left as it is, so a second run costs seconds. A peer that fails to install is
# recorded in build/peers/NAME/FAILED (the command and the end of its output; the whole
# output is in build/peers/NAME/install.log) and the others go on: the runner reports that
# peer as unavailable, with the reason, instead of failing. The script exits 0 unless its
# own usage is wrong.
#
# What each needs, as found on these machines (Debian, Python 3.11, x86-64):
#   ffcv         1.0.2 builds from its sdist against libturbojpeg and OpenCV (pkg-config g++
#                libturbojpeg0-dev libopencv-dev, installed with apt-get when missing) and
#                needs plain Pillow; torch is the CPU build dimd itself uses.
#   litdata      pure Python; CPU torch. Its metadata requires torchvision (for its own JPEG
#                decoding, which these benchmarks do not use: the records are stored as bytes),
#                which would need the CUDA torch build: litdata goes in with --no-deps and its
#                other requirements named.
#   webdataset   pure Python; CPU torch (its loader is torch's DataLoader).
#   torchvision  0.28.0 is the only release for torch 2.13.0, and its wheel does not import
#                next to the CPU torch build: this venv takes torch==2.13.0 from PyPI (the
#                CUDA build, several GB, run on CPU here), without the local wheel folder.
# pip's cache is not used (the CUDA wheels would be stored twice).
set -u

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${PEERS_DIR:-$ROOT/build/peers}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
ALL=(ffcv litdata webdataset torchvision)
# litdata 0.2.76's requirements less torchvision (see above)
LITDATA_DEPS="lightning-utilities filelock numpy boto3 requests urllib3>=1.26 tifffile obstore"

# The pins: what each venv gets (a change reinstalls that venv).
pins() {
    case $1 in
        ffcv)        echo "$TORCH_SPEC ffcv==1.0.2 pillow" ;;
        litdata)     echo "$TORCH_SPEC litdata==0.2.76 pillow" ;;
        webdataset)  echo "$TORCH_SPEC webdataset==1.0.2 pillow" ;;
        torchvision) echo "$TORCH_SPEC torchvision==0.28.0 pillow" ;;
    esac
}

# The import that proves a venv works.
probe() {
    case $1 in
        ffcv)        echo "import ffcv, ffcv.loader, ffcv.fields.rgb_image, PIL, torch" ;;
        litdata)     echo "import litdata, PIL, torch" ;;
        webdataset)  echo "import webdataset, PIL, torch" ;;
        torchvision) echo "import torchvision, torchvision.transforms, PIL, torch" ;;
    esac
}

say() { echo "peers: $*" >&2; }

apt_for_ffcv() {
    local missing=()
    command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
    command -v g++ >/dev/null 2>&1 || missing+=(g++)
    [ -e /usr/include/turbojpeg.h ] || missing+=(libturbojpeg0-dev)
    pkg-config --exists opencv4 2>/dev/null || missing+=(libopencv-dev)
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "ffcv needs ${missing[*]} (Debian packages) and this is not root" >&2
        return 1
    fi
    say "ffcv: apt-get install ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
}

install_one() {
    local name=$1 venv=$DIR/$1 pins
    pins=$(pins "$name")
    local pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-cache-dir -q)
    if [ "$name" = ffcv ]; then apt_for_ffcv || return 1; fi
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv" || return 1
    "${pip[@]}" install --upgrade pip wheel setuptools || return 1
    case $name in
        torchvision)
            # PyPI only: the local wheel folder's torch is the CPU build, next to which
            # torchvision's wheel does not import.
            env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "${pip[@]}" install $pins || return 1 ;;
        ffcv)
            # torch (the local CPU build) and numpy before ffcv, which builds against numpy
            "${pip[@]}" install "$TORCH_SPEC" numpy || return 1
            "${pip[@]}" install $pins || return 1 ;;
        litdata)
            "${pip[@]}" install "$TORCH_SPEC" pillow $LITDATA_DEPS || return 1
            "${pip[@]}" install --no-deps $pins || return 1 ;;
        *)
            "${pip[@]}" install $pins || return 1 ;;
    esac
    "$venv/bin/python" -c "$(probe "$name")" || return 1
}

one() {
    local name=$1 venv=$DIR/$1 pins
    pins=$(pins "$name")
    if [ -f "$venv/INSTALLED" ] && [ "$(cat "$venv/INSTALLED")" = "$pins" ] \
        && "$venv/bin/python" -c "$(probe "$name")" >/dev/null 2>&1; then
        say "$name: installed ($pins)"
        return 0
    fi
    mkdir -p "$venv"
    rm -f "$venv/INSTALLED" "$venv/FAILED"
    say "$name: installing $pins into $venv (log: $venv/install.log)"
    if ( set -x; install_one "$name" ) >"$venv/install.log" 2>&1; then
        echo "$pins" >"$venv/INSTALLED"
        say "$name: installed"
    else
        { echo "installing $pins failed:"; grep -v '^+' "$venv/install.log" | grep -v '^\s*$' | tail -n 15; } \
            >"$venv/FAILED"
        say "$name: FAILED (see $venv/FAILED)"
        sed 's/^/    /' "$venv/FAILED" >&2
    fi
}

names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${ALL[@]}")
for name in "${names[@]}"; do
    [ -n "$(pins "$name")" ] || { echo "peers: error: unknown peer '$name' (${ALL[*]})" >&2; exit 2; }
done
mkdir -p "$DIR"
for name in "${names[@]}"; do one "$name"; done
exit 0
