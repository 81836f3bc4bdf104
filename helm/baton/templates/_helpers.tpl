{{/* Names. KubeRay derives longer names (head Service, pods) from the RayCluster's: keep it short. */}}
{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "baton.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "baton.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "baton.labels" -}}
helm.sh/chart: {{ include "baton.chart" . }}
{{ include "baton.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "baton.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) }}
{{- end }}

{{/* Where the head mounts Baton's configuration, and the file `baton serve --config` reads. */}}
{{- define "baton.configDir" -}}/etc/baton{{- end }}
{{- define "baton.configFile" -}}{{ include "baton.configDir" . }}/config.yaml{{- end }}

{{/* A pool's replica bounds, checked: min <= replicas <= max. Argument: (list $ "prefill"). */}}
{{- define "baton.checkReplicas" -}}
{{- $pool := index (index . 0).Values (index . 1) }}
{{- $name := index . 1 }}
{{- if gt (int $pool.minReplicas) (int $pool.replicas) }}
{{- fail (printf "%s.minReplicas (%v) must not exceed %s.replicas (%v)" $name $pool.minReplicas $name $pool.replicas) }}
{{- end }}
{{- if lt (int $pool.maxReplicas) (int $pool.replicas) }}
{{- fail (printf "%s.maxReplicas (%v) must be at least %s.replicas (%v)" $name $pool.maxReplicas $name $pool.replicas) }}
{{- end }}
{{- end }}

{{/* A value of the baton section that the chart decides: set it, or fail when the user set another.
Argument: (list $section "key" value "explanation"). Returns nothing; mutates $section. */}}
{{- define "baton.derive" -}}
{{- $section := index . 0 }}
{{- $key := index . 1 }}
{{- $value := index . 2 }}
{{- if and (hasKey $section $key) (ne (toString (index $section $key)) (toString $value)) }}
{{- fail (printf "%s is %v, but the chart sets it to %v (%s): leave it out" (index . 4) (index $section $key) $value (index . 3)) }}
{{- end }}
{{- $_ := set $section $key $value }}
{{- end }}

{{/* Baton's configuration: the `baton` values plus what the Kubernetes shape decides. As YAML. */}}
{{- define "baton.config" -}}
{{- $cfg := deepCopy (.Values.baton | default dict) }}
{{- $server := deepCopy (get $cfg "server" | default dict) }}
{{- include "baton.derive" (list $server "host" "0.0.0.0" "the router listens on the pod's addresses" "baton.server.host") }}
{{- include "baton.derive" (list $server "port" (int .Values.service.port) "from service.port" "baton.server.port") }}
{{- $_ := set $cfg "server" $server }}
{{- $placement := deepCopy (get $cfg "placement" | default dict) }}
{{- include "baton.derive" (list $placement "address" "auto" "the head joins the RayCluster it runs in" "baton.placement.address") }}
{{- include "baton.derive" (list $placement "prefill_workers" (int .Values.prefill.replicas) "from prefill.replicas" "baton.placement.prefill_workers") }}
{{- include "baton.derive" (list $placement "decode_workers" (int .Values.decode.replicas) "from decode.replicas" "baton.placement.decode_workers") }}
{{- include "baton.derive" (list $placement "gpus_per_worker" (include "baton.gpusPerWorker" . | int) "from prefill.gpus and decode.gpus" "baton.placement.gpus_per_worker") }}
{{- include "baton.derive" (list $placement "api_server_count" (int .Values.router.apiServerCount) "from router.apiServerCount" "baton.placement.api_server_count") }}
{{- range $key := list "prefill_resource" "decode_resource" }}
{{- if not (hasKey $placement $key) }}
{{- /* Set to null in the values (Helm drops null keys): say so, or Baton would use its default. */}}
{{- $_ := set $placement $key nil }}
{{- end }}
{{- end }}
{{- $_ := set $cfg "placement" $placement }}
{{- $engine := deepCopy (get $cfg "engine" | default dict) }}
{{- include "baton.loraEngine" (list . $engine) }}
{{- if $engine }}
{{- $_ := set $cfg "engine" $engine }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/* LoRA is on: lora.enableLora, or adapters listed. Returns "true" or nothing. */}}
{{- define "baton.loraEnabled" -}}
{{- $lora := .Values.lora | default dict }}
{{- if or $lora.enableLora $lora.adapters }}true{{ end }}
{{- end }}

{{/* Baton's engine.lora_modules from lora.adapters: one entry a line, vLLM's `name=path`, or its
JSON form when baseModelName is given. Checks names (unique, no spaces or "=") and absolute paths. */}}
{{- define "baton.loraModules" -}}
{{- $entries := list }}
{{- $seen := dict }}
{{- range $i, $adapter := (.Values.lora.adapters | default list) }}
{{- $name := toString ($adapter.name | default "") }}
{{- $path := toString ($adapter.path | default "") }}
{{- if or (not $name) (regexMatch "[\\s=]" $name) (hasPrefix "{" $name) }}
{{- fail (printf "lora.adapters[%d].name %q: an adapter's name is what requests send as `model`: non-empty, without spaces or '=', not starting with '{'" $i $name) }}
{{- end }}
{{- if hasKey $seen $name }}
{{- fail (printf "lora.adapters: the name %q is listed twice" $name) }}
{{- end }}
{{- $_ := set $seen $name true }}
{{- if not (hasPrefix "/" $path) }}
{{- fail (printf "lora.adapters[%d] (%s): path %q must be an absolute path inside the pods (e.g. below lora.volume.mountPath, %s)" $i $name $path $.Values.lora.volume.mountPath) }}
{{- end }}
{{- if $adapter.baseModelName }}
{{- $entries = append $entries (toJson (dict "name" $name "path" $path "base_model_name" (toString $adapter.baseModelName))) }}
{{- else }}
{{- $entries = append $entries (printf "%s=%s" $name $path) }}
{{- end }}
{{- end }}
{{- join "\n" $entries }}
{{- end }}

{{/* The `lora` values into Baton's engine section (every worker of both pools runs it).
Argument: (list $ $engine). Returns nothing; mutates $engine. */}}
{{- define "baton.loraEngine" -}}
{{- $root := index . 0 }}
{{- $engine := index . 1 }}
{{- $lora := $root.Values.lora | default dict }}
{{- if include "baton.loraEnabled" $root }}
{{- include "baton.derive" (list $engine "enable_lora" true "from lora.enableLora / lora.adapters" "baton.engine.enable_lora") }}
{{- end }}
{{- with (include "baton.loraModules" $root) }}
{{- include "baton.derive" (list $engine "lora_modules" . "from lora.adapters" "baton.engine.lora_modules") }}
{{- end }}
{{- range $key, $value := dict "maxLoras" "max_loras" "maxLoraRank" "max_lora_rank" "maxCpuLoras" "max_cpu_loras" }}
{{- $given := index $lora $key }}
{{- if not (kindIs "invalid" $given) }}
{{- include "baton.derive" (list $engine $value (int $given) (printf "from lora.%s" $key) (printf "baton.engine.%s" $value)) }}
{{- end }}
{{- end }}
{{- $maxLoras := index $engine "max_loras" | default 1 | int }}
{{- $maxCpu := index $engine "max_cpu_loras" }}
{{- if and (not (kindIs "invalid" $maxCpu)) (lt (int $maxCpu) $maxLoras) }}
{{- fail (printf "lora.maxCpuLoras (%v) must be at least lora.maxLoras (%d): adapters in a step's batch are also kept in host memory" $maxCpu $maxLoras) }}
{{- end }}
{{- if and $lora.allowRuntimeLoraUpdating (not (or (get $engine "enable_lora") (get $engine "lora_modules"))) }}
{{- fail "lora.allowRuntimeLoraUpdating needs LoRA on: set lora.enableLora (or list lora.adapters)" }}
{{- end }}
{{- if and $lora.allowRuntimeLoraUpdating (or $root.Values.router.separate (gt (int $root.Values.router.apiServerCount) 1)) }}
{{- /* Each router process keeps its own list of the adapters requests may name: a run-time load
through one router would leave the others answering 404 for it. */}}
{{- fail "lora.allowRuntimeLoraUpdating needs a single router process (router.separate false, router.apiServerCount 1): each router keeps its own list of adapters, so a load through one would leave the others answering 404 for it; list the adapters in lora.adapters instead" }}
{{- end }}
{{- end }}

{{/* The LoRA adapters' volume (none for lora.volume.type none). */}}
{{- define "baton.loraVolume" -}}
{{- $v := .Values.lora.volume }}
{{- if eq $v.type "pvc" }}
{{- if not $v.pvc.claimName }}{{ fail "lora.volume.pvc.claimName is required with lora.volume.type pvc" }}{{ end }}
- name: lora-adapters
  persistentVolumeClaim:
    claimName: {{ $v.pvc.claimName }}
    readOnly: {{ $v.readOnly }}
{{- else if eq $v.type "hostPath" }}
{{- if not $v.hostPath.path }}{{ fail "lora.volume.hostPath.path is required with lora.volume.type hostPath" }}{{ end }}
- name: lora-adapters
  hostPath:
    path: {{ $v.hostPath.path }}
    type: {{ $v.hostPath.type }}
{{- else if eq $v.type "custom" }}
{{- $source := omit ($v.custom | default dict) "name" }}
{{- if not $source }}{{ fail "lora.volume.custom is required with lora.volume.type custom: a Kubernetes volume source such as {nfs: {server: ..., path: ...}}" }}{{ end }}
- name: lora-adapters
  {{- toYaml $source | nindent 2 }}
{{- end }}
{{- end }}

{{- define "baton.loraVolumeMount" -}}
{{- $v := .Values.lora.volume }}
{{- if ne $v.type "none" }}
{{- if and (ne .Values.modelSource.type "image") (eq (clean $v.mountPath) (clean .Values.modelSource.mountPath)) }}
{{- fail (printf "lora.volume.mountPath and modelSource.mountPath are both %s: mount the adapters elsewhere (or keep them on the model's volume with lora.volume.type none)" $v.mountPath) }}
{{- end }}
- name: lora-adapters
  mountPath: {{ $v.mountPath }}
  {{- if and (eq $v.type "pvc") $v.pvc.subPath }}
  subPath: {{ $v.pvc.subPath }}
  {{- end }}
  {{- if $v.readOnly }}
  readOnly: true
  {{- end }}
{{- end }}
{{- end }}

{{/* GPUs per Baton worker: one value for both pools in Baton's placement. */}}
{{- define "baton.gpusPerWorker" -}}
{{- $prefill := int .Values.prefill.gpus }}
{{- $decode := int .Values.decode.gpus }}
{{- if and (gt (int .Values.prefill.maxReplicas) 0) (ne $prefill $decode) }}
{{- fail (printf "prefill.gpus (%d) and decode.gpus (%d) differ, but Baton's placement.gpus_per_worker is one value for both pools" $prefill $decode) }}
{{- end }}
{{- $decode }}
{{- end }}

{{/* A pool's tensor-parallel size, as Baton's PlacementConfig.tp_size reads it:
baton.placement.<role>_tensor_parallel_size, else tensor_parallel_size, else 1. A worker is that
many ranks on one node (its pod). Argument: (list $ "prefill"). */}}
{{- define "baton.tpSize" -}}
{{- $placement := (index . 0).Values.baton.placement | default dict }}
{{- range $key := list "tensor_parallel_size" (printf "%s_tensor_parallel_size" (index . 1)) }}
{{- $value := get $placement $key }}
{{- if and (hasKey $placement $key) (not (kindIs "invalid" $value)) (lt (float64 $value) 1.0) }}
{{- fail (printf "baton.placement.%s is %v: a tensor-parallel size is at least 1" $key $value) }}
{{- end }}
{{- end }}
{{- get $placement (printf "%s_tensor_parallel_size" (index . 1)) | default (get $placement "tensor_parallel_size") | default 1 | int }}
{{- end }}

{{/* Accelerators of one pod of a pool (one worker): the pool's `gpus` (per rank) times its
tensor-parallel size. Argument: (list $ "prefill"). */}}
{{- define "baton.podGpus" -}}
{{- mul (int (index (index . 0).Values (index . 1)).gpus) (include "baton.tpSize" . | int) }}
{{- end }}

{{/* A CPU quantity ("4", 4, "1.5", "500m") in whole CPUs, rounded up as KubeRay hands it to `ray start`. */}}
{{- define "baton.wholeCpus" -}}
{{- $q := toString . }}
{{- if hasSuffix "m" $q }}{{ divf (float64 (trimSuffix "m" $q)) 1000 | ceil | int }}{{ else }}{{ float64 $q | ceil | int }}{{ end }}
{{- end }}

{{/* The CPUs a pool's pod gives Ray (empty when unknown): its rayStartParams num-cpus, else what
KubeRay derives, the container's CPU limit, else its CPU request. Argument: (list $ "prefill"). */}}
{{- define "baton.podRayCpus" -}}
{{- $pool := index (index . 0).Values (index . 1) }}
{{- $params := $pool.rayStartParams | default dict }}
{{- $resources := $pool.resources | default dict }}
{{- $limits := get $resources "limits" | default dict }}
{{- $requests := get $resources "requests" | default dict }}
{{- if hasKey $params "num-cpus" }}{{ include "baton.wholeCpus" (get $params "num-cpus") }}
{{- else if get $limits "cpu" }}{{ include "baton.wholeCpus" (get $limits "cpu") }}
{{- else if get $requests "cpu" }}{{ include "baton.wholeCpus" (get $requests "cpu") }}
{{- end }}
{{- end }}

{{/* Each rank of a worker asks Ray for threads_per_worker CPUs, so a worker (a pod) needs
threads_per_worker x its pool's tensor-parallel size of them: refuse a pool whose pods give Ray
fewer, where the worker would never be placed. Argument: (list $ "prefill"). */}}
{{- define "baton.checkCpus" -}}
{{- $root := index . 0 }}
{{- $role := index . 1 }}
{{- $pool := index $root.Values $role }}
{{- $placement := $root.Values.baton.placement | default dict }}
{{- $threads := get $placement "threads_per_worker" | default 0 | int }}
{{- $tp := include "baton.tpSize" . | int }}
{{- $cpus := include "baton.podRayCpus" . }}
{{- if and (gt (int $pool.maxReplicas) 0) (gt $threads 0) $cpus }}
{{- if gt (mul $threads $tp) (int $cpus) }}
{{- fail (printf "a %s worker is %d rank(s) of baton.placement.threads_per_worker (%d) CPUs each, %d CPUs, but a %s pod gives Ray %s (%s.resources or %s.rayStartParams num-cpus): give the pool more CPUs or lower threads_per_worker" $role $tp $threads (mul $threads $tp) $role $cpus $role $role) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The pool's Ray custom resource name (empty when none). Argument: (list $ "prefill"). */}}
{{- define "baton.poolResource" -}}
{{- $placement := (index . 0).Values.baton.placement | default dict }}
{{- $key := printf "%s_resource" (index . 1) }}
{{- if hasKey $placement $key }}{{ index $placement $key | default "" }}{{ end }}
{{- end }}

{{/* The model volume (none for modelSource.type image). */}}
{{- define "baton.modelVolume" -}}
{{- $src := .Values.modelSource }}
{{- if eq $src.type "pvc" }}
{{- if not $src.pvc.claimName }}{{ fail "modelSource.pvc.claimName is required with modelSource.type pvc" }}{{ end }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $src.pvc.claimName }}
    readOnly: {{ $src.pvc.readOnly }}
{{- else if eq $src.type "hostPath" }}
{{- if not $src.hostPath.path }}{{ fail "modelSource.hostPath.path is required with modelSource.type hostPath" }}{{ end }}
- name: model
  hostPath:
    path: {{ $src.hostPath.path }}
    type: {{ $src.hostPath.type }}
{{- else if eq $src.type "emptyDir" }}
- name: model
  emptyDir:
    sizeLimit: {{ $src.emptyDir.sizeLimit }}
{{- end }}
{{- end }}

{{- define "baton.modelVolumeMount" -}}
{{- $src := .Values.modelSource }}
{{- if ne $src.type "image" }}
- name: model
  mountPath: {{ $src.mountPath }}
  {{- if and (eq $src.type "pvc") $src.pvc.subPath }}
  subPath: {{ $src.pvc.subPath }}
  {{- end }}
  {{- if or (eq $src.type "hostPath") (and (eq $src.type "pvc") $src.pvc.readOnly) }}
  readOnly: true
  {{- end }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by the head and the worker groups. Argument: (list $ $group). */}}
{{- define "baton.podSpec" -}}
{{- $root := index . 0 }}
{{- $group := index . 1 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with ($group.runtimeClassName | default $root.Values.runtimeClassName) }}
runtimeClassName: {{ . }}
{{- end }}
{{- with ($group.priorityClassName | default $root.Values.priorityClassName) }}
priorityClassName: {{ . }}
{{- end }}
{{- with $root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if and $root.Values.modelSource.initContainers (ne $root.Values.modelSource.type "image") }}
initContainers:
  {{- range $root.Values.modelSource.initContainers }}
  - {{- toYaml . | nindent 4 }}
    {{- if not (hasKey . "volumeMounts") }}
    volumeMounts:
      {{- include "baton.modelVolumeMount" $root | nindent 6 }}
    {{- end }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Env and envFrom of a Ray container: the chart-wide lists, then the group's. */}}
{{- define "baton.env" -}}
{{- $root := index . 0 }}
{{- $group := index . 1 }}
{{- $env := concat ($root.Values.env | default list) ($group.env | default list) }}
{{- if ($root.Values.lora | default dict).allowRuntimeLoraUpdating }}
{{- $named := false }}
{{- range $env }}{{ if eq .name "BATON_ALLOW_RUNTIME_LORA_UPDATING" }}{{ $named = true }}{{ end }}{{ end }}
{{- if not $named }}
{{- /* vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: the routers read it, in the head and router pods. */}}
{{- $env = prepend $env (dict "name" "BATON_ALLOW_RUNTIME_LORA_UPDATING" "value" "1") }}
{{- end }}
{{- end }}
{{- $envFrom := concat ($root.Values.envFrom | default list) ($group.envFrom | default list) }}
{{- with $env }}
env:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Labels of a group's pods. Argument: (list $ $group "component"). */}}
{{- define "baton.podLabels" -}}
{{- $root := index . 0 }}
{{- $group := index . 1 }}
{{- include "baton.selectorLabels" $root }}
app.kubernetes.io/component: {{ index . 2 }}
{{- with (merge (deepCopy ($group.podLabels | default dict)) ($root.Values.podLabels | default dict)) }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The pods the Service sends traffic to: the router Deployment's, or the head's. */}}
{{- define "baton.routerComponent" -}}
{{- if .Values.router.separate }}router{{ else }}head{{ end }}
{{- end }}
