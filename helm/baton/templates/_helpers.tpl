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
{{- toYaml $cfg }}
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
