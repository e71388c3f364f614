{{/* The chart's name and version, as the helm.sh/chart label writes them. */}}
{{- define "hostpid-broker.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The namespace every namespaced object goes to: the release's (helm install -n NAMESPACE), the
Helm convention, unless namespace.name names another one.
*/}}
{{- define "hostpid-broker.namespace" -}}
{{- .Values.namespace.name | default .Release.Namespace }}
{{- end }}

{{/*
The labels Helm charts put on every object (Kubernetes' recommended labels), without the
component; for a part of the release other than the broker, add its own component to these.
*/}}
{{- define "hostpid-broker.commonLabels" -}}
app.kubernetes.io/name: hostpid-broker
{{ include "hostpid-broker.releaseLabels" . }}
{{- end }}

{{/*
The labels of the release on every object of every part (broker, webhook, NRI plugin): which
release, which version of the software and of the chart, who manages it, plus commonLabels.
*/}}
{{- define "hostpid-broker.releaseLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hostpid
helm.sh/chart: {{ include "hostpid-broker.chart" . }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels on every object of the broker: the common ones and its component. */}}
{{- define "hostpid-broker.labels" -}}
{{ include "hostpid-broker.commonLabels" . }}
app.kubernetes.io/component: broker
{{- end }}

{{/*
The DaemonSet's selector: app.kubernetes.io/name alone, as the raw manifests have always had
it (a DaemonSet's selector cannot change on upgrade).
*/}}
{{- define "hostpid-broker.selector" -}}
app.kubernetes.io/name: hostpid-broker
{{- end }}

{{/*
One setting that may be given under two names: this chart's short one (.short, .shortName) and
the design's (.long, .longName, as in HAMi's chart: devicePlugin.*).  Unset (null or absent)
means not given; both given and different fails the render naming both.  The result, as JSON:
{"value": ..., "name": the name it came from (the short one when neither was given)}.
*/}}
{{- define "hostpid-broker.oneSetting" -}}
{{- $short := not (kindIs "invalid" .short) -}}
{{- $long := not (kindIs "invalid" .long) -}}
{{- if and $short $long (ne (toString .short) (toString .long)) -}}
{{- fail (printf "%s=%v and %s=%v disagree: they are the same setting under two names (the design's and this chart's); give one of them, or the same value to both" .longName .long .shortName .short) -}}
{{- end -}}
{{- if $long -}}
{{- dict "value" .long "name" .longName | toJson -}}
{{- else if $short -}}
{{- dict "value" .short "name" .shortName | toJson -}}
{{- else -}}
{{- dict "value" .default "name" .shortName | toJson -}}
{{- end -}}
{{- end }}

{{/* hostPID or devicePlugin.hostPID (default true), as {"value", "name"} JSON. */}}
{{- define "hostpid-broker.hostPID" -}}
{{- $dp := .Values.devicePlugin | default dict -}}
{{- include "hostpid-broker.oneSetting" (dict "short" .Values.hostPID "shortName" "hostPID" "long" $dp.hostPID "longName" "devicePlugin.hostPID" "default" true) -}}
{{- end }}

{{/*
hostPIDBroker.enabled or devicePlugin.hostPIDBroker.enabled (default false), as {"value",
"name"} JSON.
*/}}
{{- define "hostpid-broker.enabled" -}}
{{- $short := .Values.hostPIDBroker | default dict -}}
{{- $dp := .Values.devicePlugin | default dict -}}
{{- $long := $dp.hostPIDBroker | default dict -}}
{{- include "hostpid-broker.oneSetting" (dict "short" $short.enabled "shortName" "hostPIDBroker.enabled" "long" $long.enabled "longName" "devicePlugin.hostPIDBroker.enabled" "default" false) -}}
{{- end }}

{{/* "true" when the gate is on (either spelling of hostPIDBroker.enabled), else "". */}}
{{- define "hostpid-broker.isEnabled" -}}
{{- if (include "hostpid-broker.enabled" . | fromJson).value }}true{{ end }}
{{- end }}

{{/* The gate's value in the broker pod: the exact string "1" only when enabled. */}}
{{- define "hostpid-broker.gate" -}}
{{- if include "hostpid-broker.isEnabled" . }}1{{ else }}0{{ end }}
{{- end }}

{{/* The --metrics endpoint: tcp, or tcp6 with the address's colons escaped. */}}
{{- define "hostpid-broker.metricsEndpoint" -}}
{{- $address := .Values.metrics.bindAddress -}}
{{- if contains ":" $address -}}
tcp6:{{ .Values.metrics.port }}:interface={{ $address | replace ":" "\\:" }}
{{- else -}}
tcp:{{ .Values.metrics.port }}:interface={{ $address }}
{{- end }}
{{- end }}

{{- define "hostpid-broker.loopbackMetrics" -}}
{{- $address := .Values.metrics.bindAddress -}}
{{- if or (hasPrefix "127." $address) (eq $address "::1") (eq $address "localhost") }}true{{ end }}
{{- end }}

{{/*
An exec probe: `hostpid probe` on the broker socket, skipped while the gate is off (exactly
the broker's rule: only "1" enables).
*/}}
{{- define "hostpid-broker.probeCommand" -}}
- sh
- -c
- '[ "$LIBVGPU_HOSTPID_BROKER" != 1 ] || {{ if .ready }}{ [ -e {{ include "hostpid-broker.readyFile" .root }} ] && {{ end }}exec hostpid probe --socket {{ .root.Values.broker.directory }}/broker.sock --timeout {{ .probe.deadline }}{{ if .ready }}; }{{ end }}'
{{- end }}

{{/*
The file the broker keeps only while it holds the listener (--ready-file), in the pod's own
emptyDir: during a handover both brokers answer on the socket, and only this tells the new
pod's readiness probe that its own broker holds it.
*/}}
{{- define "hostpid-broker.readyFile" -}}
/run/hostpid-ready/ready
{{- end }}

{{/*
The combinations that cannot work fail the render, each with one message naming the values.
*/}}
{{- define "hostpid-broker.rules" -}}
{{- $v := .Values -}}
{{- $hostPID := include "hostpid-broker.hostPID" . | fromJson }}
{{- $enabled := include "hostpid-broker.enabled" . | fromJson }}
{{- if and $enabled.value (not $hostPID.value) }}
{{- fail (printf "%s=true requires %s=true: without the host PID namespace the broker would report PIDs of its own namespace (it refuses to start there); set %s=true or %s=false" $enabled.name $hostPID.name $hostPID.name $enabled.name) }}
{{- end }}
{{- $namespace := include "hostpid-broker.namespace" . }}
{{- if and $v.namespace.create (eq $namespace .Release.Namespace) }}
{{- fail (printf "namespace.create=true renders namespace %s, which cannot hold the release that creates it: leave namespace.create=false and install with -n %s --create-namespace (labelling it for Pod Security yourself), or set namespace.name to a namespace other than the release's" $namespace $namespace) }}
{{- end }}
{{- range $monitor := list "podMonitor" "serviceMonitor" }}
{{- if (index $v $monitor).enabled }}
{{- if not $v.metrics.enabled }}
{{- fail (printf "%s.enabled=true requires metrics.enabled=true: there is no metrics port to scrape" $monitor) }}
{{- end }}
{{- if include "hostpid-broker.loopbackMetrics" $ }}
{{- fail (printf "%s.enabled=true cannot scrape metrics.bindAddress=%s: a loopback address is reachable only inside the pod" $monitor $v.metrics.bindAddress) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $probe := list "livenessProbe" "readinessProbe" }}
{{- $p := index $v $probe }}
{{- if lt (float64 $p.timeoutSeconds) (addf $p.deadline 1) }}
{{- fail (printf "%s.timeoutSeconds=%v must be at least %s.deadline=%v plus 1 s: the kubelet would end the probe before its deadline (it starts a Python process first)" $probe $p.timeoutSeconds $probe $p.deadline) }}
{{- end }}
{{- end }}
{{- if eq (clean $v.broker.lockParent) "/" }}
{{- fail "broker.lockParent must not be /: its parent directory is mounted from the host" }}
{{- end }}
{{- end }}

{{/*
The admission webhook's labels: its own app.kubernetes.io/name, so that nothing selecting the
brokers (the DaemonSet, the NetworkPolicy, the monitors) ever selects a webhook pod.
*/}}
{{- define "hostpid-broker.webhookSelector" -}}
app.kubernetes.io/name: hostpid-webhook
app.kubernetes.io/component: webhook
{{- end }}

{{- define "hostpid-broker.webhookLabels" -}}
{{ include "hostpid-broker.webhookSelector" . }}
{{ include "hostpid-broker.releaseLabels" . }}
{{- end }}

{{- define "hostpid-broker.nriSelector" -}}
app.kubernetes.io/name: hostpid-nri
app.kubernetes.io/component: nri-plugin
{{- end }}

{{- define "hostpid-broker.nriLabels" -}}
{{ include "hostpid-broker.nriSelector" . }}
{{ include "hostpid-broker.releaseLabels" . }}
{{- end }}

{{- /* The DaemonSets' affinity: the operator's `affinity`, with the GPU nodes (gpuNodes: label
       maps, ORed) as required node affinity.  Node selector terms are ORed and the
       expressions of one term ANDed, so an operator's own required terms are ANDed with the
       GPU nodes' by pairing each of theirs with each of ours (their expressions first).
       YAML, "{}" when there is nothing to render. */ -}}
{{- define "hostpid-broker.affinity" -}}
{{- $affinity := deepCopy (.Values.affinity | default dict) }}
{{- $gpuTerms := list }}
{{- range .Values.gpuNodes }}
{{- $expressions := list }}
{{- range $key, $value := . }}
{{- $expressions = append $expressions (dict "key" $key "operator" "In" "values" (list $value)) }}
{{- end }}
{{- $gpuTerms = append $gpuTerms (dict "matchExpressions" $expressions) }}
{{- end }}
{{- if $gpuTerms }}
{{- $nodeAffinity := $affinity.nodeAffinity | default dict }}
{{- $required := $nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution | default dict }}
{{- $terms := $gpuTerms }}
{{- with $required.nodeSelectorTerms }}
{{- $terms = list }}
{{- range $own := . }}
{{- range $gpu := $gpuTerms }}
{{- $term := deepCopy $own }}
{{- $_ := set $term "matchExpressions" (concat ($own.matchExpressions | default list) $gpu.matchExpressions) }}
{{- $terms = append $terms $term }}
{{- end }}
{{- end }}
{{- end }}
{{- $_ := set $required "nodeSelectorTerms" $terms }}
{{- $_ := set $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" $required }}
{{- $_ := set $affinity "nodeAffinity" $nodeAffinity }}
{{- end }}
{{- toYaml $affinity }}
{{- end }}

{{- /* gpuNodes as an operator reads it: "gpu=on OR nvidia.com/gpu.present=true". */ -}}
{{- define "hostpid-broker.gpuNodesText" -}}
{{- $maps := list }}
{{- range .Values.gpuNodes }}
{{- $pairs := list }}
{{- range $key, $value := . }}{{ $pairs = append $pairs (printf "%s=%s" $key $value) }}{{ end }}
{{- $maps = append $maps (join "," $pairs) }}
{{- end }}
{{- join " OR " $maps | default "none: gpuNodes is empty" }}
{{- end }}
