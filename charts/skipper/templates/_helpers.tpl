{{/*
The prefix of every object name: the release name, or fullnameOverride.
*/}}
{{- define "skipper.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "skipper.controller" -}}{{ include "skipper.fullname" . }}-controller{{- end -}}
{{- define "skipper.router" -}}{{ include "skipper.fullname" . }}-router{{- end -}}

{{/*
Labels of every object: the selector labels of the component (part of the
contract for controllers: they are the ring's membership selector) plus
Helm's bookkeeping labels and commonLabels.
*/}}
{{- define "skipper.labels" -}}
app.kubernetes.io/name: skipper
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Labels of a component's pods: its selector labels and the release (no
versions: a chart upgrade that changes nothing else does not roll pods).
*/}}
{{- define "skipper.podLabels" -}}
{{ include "skipper.selectorLabels" . }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{- define "skipper.selectorLabels" -}}
app.kubernetes.io/name: skipper
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
metadata.labels and metadata.annotations of an object: include with
(dict "root" $ "component" "controller" ["annotations" (dict …)]).
*/}}
{{- define "skipper.metadata" -}}
labels:
  {{- include "skipper.labels" . | nindent 2 }}
{{- with merge (dict) (default (dict) .annotations) .root.Values.commonAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "skipper.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}:{{ $tag }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end -}}

{{- define "skipper.pasetoSecret" -}}
{{- default (printf "%s-paseto" (include "skipper.controller" .)) .Values.paseto.existingSecret -}}
{{- end -}}

{{/*
The environment of a component's container from its `flags`: each flag name
becomes SKIPPER_<NAME>. Flags the chart sets itself are refused, saying
how it sets them. Include with (dict "root" $ "component" "controller"
"owned" (dict "flag" "how the chart sets it")).
*/}}
{{- define "skipper.flagEnv" -}}
{{- $values := index .root.Values .component -}}
{{- range $flag, $value := $values.flags }}
{{- if hasKey $.owned $flag }}
{{- fail (printf "%s.flags.%s: the chart sets --%s itself: %s" $.component $flag $flag (index $.owned $flag)) }}
{{- end }}
{{- if not (regexMatch "^[a-z][a-z0-9-]*$" $flag) }}
{{- fail (printf "%s.flags.%s: not a flag name (write it as on the command line, without the dashes: heartbeat-timeout)" $.component $flag) }}
{{- end }}
- name: SKIPPER_{{ $flag | upper | replace "-" "_" }}
  value: {{ toString $value | quote }}
{{- end }}
{{- end -}}

{{/*
Topology spread constraints; one without a labelSelector selects the
component's pods.
*/}}
{{- define "skipper.topologySpread" -}}
{{- $component := .component -}}
{{- range .constraints }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" (dict "app.kubernetes.io/name" "skipper" "app.kubernetes.io/component" $component)) }}
{{- end }}
- {{ toYaml $c | nindent 2 | trim }}
{{- end }}
{{- end -}}

{{/*
The grace period: preStop sleep (or the router's shutdown delay) +
shutdown timeout + 15 s, unless set.
*/}}
{{- define "skipper.gracePeriod" -}}
{{- if .terminationGracePeriodSeconds -}}
{{ .terminationGracePeriodSeconds }}
{{- else -}}
{{ add .preStopSleepSeconds .shutdownTimeoutSeconds 15 }}
{{- end -}}
{{- end -}}

{{/*
The cluster-scoped objects' name: <prefix>-controller-token-review, with the
namespace in front when it is not the prefix (two releases of one name in
two namespaces do not collide).
*/}}
{{- define "skipper.tokenReview" -}}
{{- if eq .Release.Namespace (include "skipper.fullname" .) -}}
{{ include "skipper.controller" . }}-token-review
{{- else -}}
{{ .Release.Namespace }}-{{ include "skipper.controller" . }}-token-review
{{- end -}}
{{- end -}}
