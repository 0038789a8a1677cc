#!/usr/bin/env bash
# Give each GPU node's oomcast agent its own key, and nothing more: writes
# `oomcast control-key --node <node>` to /etc/oomcast/node-key on that node (root, mode 0400),
# where agent-daemonset.yaml mounts it from. Run it from an admin's shell that holds the
# master secret (OOMCAST_CONTROL_SECRET, the one the service's Secret has) and kubectl rights
# to debug nodes; never on a node. Run it again for nodes added later, and after rotating
# the master secret.
#
#   OOMCAST_CONTROL_SECRET=... deploy/kubernetes/provision-node-keys.sh [label-selector]
#
# The selector defaults to the DaemonSet's (nvidia.com/gpu.present=true). Each node gets a
# short-lived `kubectl debug node/...` pod (image: $OOMCAST_PROVISION_IMAGE, busybox by
# default) that writes the file through the host's root at /host and is deleted after.
# Where nodes are built by configuration management (cloud-init, Ansible, an image), write
# the same file there instead: this script is one way, not the only one.
set -euo pipefail

selector="${1:-nvidia.com/gpu.present=true}"
image="${OOMCAST_PROVISION_IMAGE:-busybox:1.36}"
oomcast="${OOMCAST_BIN:-oomcast}"
: "${OOMCAST_CONTROL_SECRET:?set OOMCAST_CONTROL_SECRET (the master secret) to derive node keys}"

write='umask 077 && mkdir -p /host/etc/oomcast && cat > /host/etc/oomcast/node-key.tmp && chmod 0400 /host/etc/oomcast/node-key.tmp && mv /host/etc/oomcast/node-key.tmp /host/etc/oomcast/node-key'

nodes=$(kubectl get nodes -l "$selector" -o jsonpath='{.items[*].metadata.name}')
if [ -z "$nodes" ]; then
  echo "no node matches $selector" >&2
  exit 1
fi
for node in $nodes; do
  "$oomcast" control-key --node "$node" \
    | kubectl debug "node/$node" -i --quiet --image="$image" --profile=sysadmin -- sh -c "$write"
  # the debugger pods are named node-debugger-<node>-<suffix>; leave none behind
  { kubectl get pods -o name | grep "^pod/node-debugger-$node-" || true; } \
    | xargs -r kubectl delete --wait=false >/dev/null
  echo "node $node: key written to /etc/oomcast/node-key" >&2
done
