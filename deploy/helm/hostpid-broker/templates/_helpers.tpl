{{/*
Labels on every object: the ones the raw manifests always carried (the DaemonSet's selector
is app.kubernetes.io/name alone, and a selector cannot change), plus commonLabels.
*/}}
{{- define "hostpid-broker.labels" -}}
app.kubernetes.io/name: hostpid-broker
app.kubernetes.io/part-of: hostpid
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "hostpid-broker.selector" -}}
app.kubernetes.io/name: hostpid-broker
{{- end }}

{{/* The gate's value in the broker pod: the exact string "1" only when enabled. */}}
{{- define "hostpid-broker.gate" -}}
{{- if .Values.hostPIDBroker.enabled }}1{{ else }}0{{ end }}
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
{{- if and $v.hostPIDBroker.enabled (not $v.hostPID) }}
{{- fail "hostPIDBroker.enabled=true requires hostPID=true: without the host PID namespace the broker would report PIDs of its own namespace (it refuses to start there); set hostPID=true or hostPIDBroker.enabled=false" }}
{{- end }}
{{- if and $v.namespace.create (eq $v.namespace.name .Release.Namespace) }}
{{- fail (printf "namespace.create=true makes the release create namespace %s, so the release cannot be stored in it: install into another namespace (--namespace default), or create and label %s yourself and set namespace.create=false" $v.namespace.name $v.namespace.name) }}
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
