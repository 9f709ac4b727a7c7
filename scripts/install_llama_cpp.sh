#!/usr/bin/env bash
# llama.cpp for the parity report and the suite, with nothing compiled: the npm package node-llama-cpp and
# its prebuilt linux-x64 CPU binary only (every other platform's optional binary left out: 85 MB instead of
# about 725), installed into .llama-cpp/ (git-ignored) or $QLORA_KIT_LLAMA_CPP. NODE_LLAMA_CPP_SKIP_DOWNLOAD
# stops its postinstall from fetching or building anything. Needs node >= 20 and npm.
set -euo pipefail
cd "$(dirname "$0")/.."
folder="${QLORA_KIT_LLAMA_CPP:-.llama-cpp}"
version=3.22.1
mkdir -p "$folder"
cd "$folder"
[ -f package.json ] || echo '{"private": true}' > package.json
case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) binary="@node-llama-cpp/linux-x64@$version" ;;
  Linux-aarch64) binary="@node-llama-cpp/linux-arm64@$version" ;;
  Darwin-arm64) binary="@node-llama-cpp/mac-arm64-metal@$version" ;;
  Darwin-x86_64) binary="@node-llama-cpp/mac-x64@$version" ;;
  *) echo "install_llama_cpp.sh: no prebuilt llama.cpp for $(uname -s)-$(uname -m)" >&2; exit 2 ;;
esac
NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm install --no-audit --no-fund --loglevel=error --omit=optional \
  "node-llama-cpp@$version" "$binary"
