{{/*
Names, labels and the operator's RBAC rules, shared by every template.
*/}}

{{- define "adaserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Object-name prefix, at most 63 characters (the DNS label limit): the release name when it already contains
the chart name, else "<release>-<chart>".
*/}}
{{- define "adaserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "adaserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels of the operator pods. Deliberately distinct from the labels the operator puts on the
children it creates (app.kubernetes.io/managed-by: adaserve-operator), so no selector overlaps.
*/}}
{{- define "adaserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "adaserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "adaserve.labels" -}}
helm.sh/chart: {{ include "adaserve.chart" . }}
{{ include "adaserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: adaserve
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "adaserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "adaserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "adaserve.image" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{/*
RBAC: exactly the list in docs/k8s-contract.md ("What the operator may touch"), split by scope.
Rules on namespaced resources: in the ClusterRole when every namespace is watched, else in a Role per
watched namespace.
*/}}
{{- define "adaserve.rules.namespaced" -}}
- apiGroups: [adaserve.io]
  resources: [adaservedeployments]
  verbs: [get, list, watch, patch, update]
- apiGroups: [adaserve.io]
  resources: [adaservedeployments/status]
  verbs: [get, patch, update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- if .Values.rbac.readSecrets }}
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}
{{- end }}

{{/*
Cluster-scoped reads kopf needs in either mode: discovering CRDs and namespaces.
*/}}
{{- define "adaserve.rules.cluster" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [namespaces]
  verbs: [get, list, watch]
{{- end }}

{{/*
Cluster-wide peering: only an operator serving every namespace uses ClusterKopfPeering.
*/}}
{{- define "adaserve.rules.clusterPeering" -}}
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
