{{/* Names, labels and the RBAC rules shared by the templates. */}}

{{- define "pdserve.fullname" -}}
{{- if contains "pdserve" .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-pdserve-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator pods' name label is fixed: per-service NetworkPolicies (rendered by the
operator, children.OPERATOR_POD_LABELS) name the operator by it. */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: pdserve-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pdserve.operatorImage" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "pdserve.workerImage" -}}
{{- printf "%s:%s" .Values.workerImage.repository (default .Chart.AppVersion .Values.workerImage.tag) -}}
{{- end -}}

{{/* The vLLM variant of the worker image for a device type: (list $ "cpu"|"cuda"|"npu"). Set in
values, that; else the worker image's tag with the suffix worker/Dockerfile's header tags it with. */}}
{{- define "pdserve.vllmImage" -}}
{{- $root := index . 0 -}}
{{- $device := index . 1 -}}
{{- $suffix := dict "cpu" "vllm-cpu" "cuda" "vllm-cuda" "npu" "vllm-ascend" -}}
{{- $set := index ($root.Values.workerImage.vllm | default dict) $device | default "" -}}
{{- if $set -}}
{{- $set -}}
{{- else -}}
{{- printf "%s:%s-%s" $root.Values.workerImage.repository (default $root.Chart.AppVersion $root.Values.workerImage.tag) (index $suffix $device) -}}
{{- end -}}
{{- end -}}

{{/* Namespace-scoped permissions: exactly the calls the operator makes (tests/e2e/test_chart_install.py
records them against the API emulator and checks both directions). */}}
{{- define "pdserve.namespacedRules" -}}
- apiGroups: [pdserve.dev]
  resources: [pdinferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [pdserve.dev]
  resources: [pdinferenceservices/status]
  verbs: [patch]
# Children carry ownerReferences with blockOwnerDeletion; clusters running the
# OwnerReferencesPermissionEnforcement admission plugin (OpenShift) allow that only to whoever
# may update the owner's finalizers.
- apiGroups: [pdserve.dev]
  resources: [pdinferenceservices/finalizers]
  verbs: [update]
# One PDScalingAdapter per role (a /scale target each): made, synced, and its status written.
- apiGroups: [pdserve.dev]
  resources: [pdscalingadapters]
  verbs: [get, list, watch, create, patch]
- apiGroups: [pdserve.dev]
  resources: [pdscalingadapters/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [configmaps, secrets, services]
  verbs: [get, list, watch, create, patch]
- apiGroups: [apps]
  resources: [deployments, statefulsets]
  verbs: [get, list, watch, create, patch]
# The built-in autoscaler writes an autoscaled role's replicas where an HPA does.
- apiGroups: [apps]
  resources: [deployments/scale, statefulsets/scale]
  verbs: [patch]
# spec.autoscaling.<role>.driver hpa: the operator renders (and removes) the role's HPA.
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if .Values.networkPolicy.enabled }}
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch]
{{- end }}
{{- if .Values.inferencePool.enabled }}
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch]
- apiGroups: [{{ splitList "/" .Values.inferencePool.objectiveApiVersion | first }}]
  resources: [inferenceobjectives]
  verbs: [get, create, patch]
{{- end }}
{{- if .Values.leaderWorkerSet.enabled }}
# spec.decode.groupScheduling leaderWorkerSet: decode groups as LeaderWorkerSets (scaled through
# /scale like the StatefulSet, watched so a group's readiness shows at once), and a switch of
# groupScheduling removes the workload of the other kind.
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets/scale]
  verbs: [patch]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [delete]
{{- end }}
{{- if .Values.disaggregatedSet.enabled }}
# spec.workload DisaggregatedSet: prefill and decode as one DisaggregatedSet (sigs.k8s.io/lws); a
# switch to it removes the prefill Deployment and the decode StatefulSet, a switch back removes it.
- apiGroups: [disaggregatedset.x-k8s.io]
  resources: [disaggregatedsets]
  verbs: [get, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments, statefulsets]
  verbs: [delete]
{{- end }}
{{- if and .Values.peering.enabled .Values.watchNamespaces }}
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [list, watch, patch]
{{- end }}
{{- end -}}

{{/* Cluster-scoped permissions. */}}
{{- define "pdserve.clusterRules" -}}
# kopf follows CRDs to notice its resources appear and disappear.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
# The broker checks a worker pod's identity token (which member it may register) by TokenReview.
- apiGroups: [authentication.k8s.io]
  resources: [tokenreviews]
  verbs: [create]
{{- if .Values.watchNamespaces }}
# kopf follows the namespaces it serves (they may come and go).
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- else if .Values.peering.enabled }}
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [list, watch, patch]
{{- end }}
{{- end -}}
