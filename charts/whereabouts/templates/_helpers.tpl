{{/*
The labels Helm adds to the metadata of every templated object, on top of those of config/default.
e2e/helm-test.sh ignores exactly these four when it compares the chart with config/default.
*/}}
{{- define "whereabouts.chartLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{/*
metadata.labels: config/default's app.kubernetes.io/name (when the object has one) and the chart's.
  {{- include "whereabouts.labels" (dict "ctx" $ "name" "whereabouts-operator") | nindent 4 }}
  {{- include "whereabouts.labels" (dict "ctx" $) | nindent 4 }}
*/}}
{{- define "whereabouts.labels" -}}
{{- with .name -}}
app.kubernetes.io/name: {{ . }}
{{ end -}}
{{ include "whereabouts.chartLabels" .ctx }}
{{- end }}

{{/* The image of every container (both binaries are in it). */}}
{{- define "whereabouts.image" -}}
image: {{ printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) | quote }}
{{- with .Values.image.pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end }}

{{/* The operator's namespace: operator.namespace, or the release namespace when that is empty. */}}
{{- define "whereabouts.operatorNamespace" -}}
{{- .Values.operator.namespace | default .Release.Namespace -}}
{{- end }}
