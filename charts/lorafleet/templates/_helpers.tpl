{{- define "lorafleet.name" -}}lorafleet{{- end -}}

{{- define "lorafleet.fullname" -}}
{{- if contains "lorafleet" .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-lorafleet" .Release.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "lorafleet.labels" -}}
app.kubernetes.io/name: {{ include "lorafleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "lorafleet.workerSelector" -}}
app.kubernetes.io/name: {{ include "lorafleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: worker
{{- end -}}

{{- define "lorafleet.operatorSelector" -}}
app.kubernetes.io/name: {{ include "lorafleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The operator's allowed Prometheus origins: operator.prometheusURLs and the chart's own pool's. */}}
{{- define "lorafleet.prometheusURLs" -}}
{{- $urls := .Values.operator.prometheusURLs | default list -}}
{{- $scaling := .Values.pool.scaling | default dict -}}
{{- if and .Values.worker.enabled .Values.pool.create $scaling.prometheusURL -}}
{{- $url := urlParse $scaling.prometheusURL -}}
{{- $urls = append $urls (printf "%s://%s" $url.scheme $url.host) -}}
{{- end -}}
{{- $urls | uniq | join "," -}}
{{- end -}}

{{/* The engine's /metrics port, when it has one of its own (worker.metricsPort; refused when it is a port the
pod already uses). */}}
{{- define "lorafleet.engineMetricsPort" -}}
{{- $metrics := .Values.worker.metricsPort -}}
{{- $taken := list (int .Values.worker.port) (int .Values.worker.stagerPort) -}}
{{- if not (kindIs "invalid" .Values.worker.adminPort) }}{{ $taken = append $taken (int .Values.worker.adminPort) }}{{ end -}}
{{- if has (int $metrics) $taken -}}
{{- fail (printf "worker.metricsPort %v is worker.port, worker.stagerPort or worker.adminPort too: /metrics needs a port of its own (or null: on worker.port)" $metrics) -}}
{{- else -}}{{ $metrics }}{{- end -}}
{{- end -}}

{{/* The engine's admin API port, where the stager sidecar calls it over loopback: worker.adminPort (its own
listener, refused when it is a port the pod already uses), else worker.port (null: beside the OpenAI API). */}}
{{- define "lorafleet.engineAdminPort" -}}
{{- $admin := .Values.worker.adminPort -}}
{{- if kindIs "invalid" $admin -}}{{ .Values.worker.port }}
{{- else if has (int $admin) (list (int .Values.worker.port) (int .Values.worker.stagerPort)) -}}
{{- fail (printf "worker.adminPort %v is worker.port or worker.stagerPort too: the admin API needs a port of its own (or null: on worker.port)" $admin) -}}
{{- else -}}{{ $admin }}{{- end -}}
{{- end -}}

{{/* Install-time refusals of values that render valid objects which cannot work: the stager sidecar on the
engine's port (one of them fails to bind, for ever), workers without API keys outside development mode (open to
every caller), an operator watching a namespace other than the
release's while the chart puts its pool and workers in the release's (nothing would reconcile them), byte counts
written as quantities (both containers exit 2; values.schema.json refuses them too, unless skipped), and an
operator or workers alone in a release with a stager token of its own (every push to the workers is 401). */}}
{{- define "lorafleet.checks" -}}
{{- $cache := .Values.worker.adapterCache -}}
{{- range $key := list "sizeBytes" "maxFileBytes" "limitBytes" -}}
{{- $v := get $cache $key -}}
{{- $optional := and (eq $key "limitBytes") (or (not (hasKey $cache $key)) (kindIs "invalid" $v)) -}}
{{- if not (or $optional (has (kindOf $v) (list "int" "int64" "float64"))) -}}
{{- fail (printf "worker.adapterCache.%s %v: a number of bytes (e.g. 48318382080 for 45Gi), not a quantity" $key $v) -}}
{{- end -}}
{{- end -}}
{{- if and (ne .Values.operator.enabled .Values.worker.enabled) (not (or .Values.secrets.existingStagerTokenSecret .Values.secrets.stagerToken)) -}}
{{- fail (printf "%s without %s: the operator of one release pushes to the workers of another, and the two releases must share one stager token (else every push is refused, 401). Create a Secret with the key token (in both namespaces when they differ) and set secrets.existingStagerTokenSecret to its name in both releases, or the same secrets.stagerToken in both" (ternary "operator.enabled" "worker.enabled" .Values.operator.enabled) (ternary "worker.enabled" "operator.enabled" .Values.operator.enabled)) -}}
{{- end -}}
{{- if eq (int .Values.worker.stagerPort) (int .Values.worker.port) -}}
{{- fail (printf "worker.stagerPort %v is worker.port too: the stager sidecar and the engine share the pod's network, so each needs a port of its own" .Values.worker.stagerPort) -}}
{{- end -}}
{{- $ownKeys := false -}}{{- range .Values.worker.extraArgs -}}{{- if hasPrefix "--api-keys-file" (toString .) -}}{{- $ownKeys = true -}}{{- end -}}{{- end -}}
{{- if and .Values.worker.enabled (not (or .Values.secrets.existingApiKeysSecret .Values.secrets.apiKeys $ownKeys)) (not .Values.worker.developmentMode) -}}
{{- fail "no API keys (secrets.apiKeys or secrets.existingApiKeysSecret): the workers would serve every caller every tenant's adapters. Give the tenants' keys, or set worker.developmentMode=true for a trial" -}}
{{- end -}}
{{- $watch := .Values.operator.watchNamespace -}}
{{- if and .Values.operator.enabled $watch (ne $watch "*") (ne $watch .Release.Namespace) (or .Values.pool.create .Values.worker.enabled) -}}
{{- fail (printf "operator.watchNamespace %q is not the release namespace %q, where this chart puts its pool and workers: the operator would neither see nor be allowed to reconcile them. Install into %q, watch \"*\", or set pool.create=false and worker.enabled=false" $watch .Release.Namespace $watch) -}}
{{- end -}}
{{- end -}}

{{/* A checksum of the tokens and credentials given in values that containers read as env at start: a changed
one rolls the pods, so the operator and the workers never run with different stager or admin tokens. Tokens
generated at install are left out (kept across upgrades: nothing to roll), and so are the API keys (a mounted
file each worker reads again when it changes: rotating a key restarts nothing). */}}
{{- define "lorafleet.secretsChecksum" -}}
{{- $s := .Values.secrets -}}{{- $o := .Values.objectStore -}}
{{ list $s.adminToken $s.stagerToken $s.existingAdminTokenSecret $s.existingStagerTokenSecret $o.existingSecret $o.accessKey $o.secretKey | toJson | sha256sum }}
{{- end -}}

{{/* A Kubernetes quantity (50Gi, 500M, 1073741824) in bytes: list (the quantity) (the value's name for the refusal).
Fails on a form it cannot read (51.5Gi, 5e10, 50GB) rather than give a wrong size. */}}
{{- define "lorafleet.quantityBytes" -}}
{{- $q := index . 0 -}}{{- $name := index . 1 -}}
{{- if has (kindOf $q) (list "int" "int64" "float64") -}}{{ int64 $q }}
{{- else -}}
{{- $q = toString $q -}}
{{- $n := regexFind "^[0-9]+" $q -}}
{{- $units := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000 -}}
{{- $unit := trimPrefix $n $q -}}
{{- if not (and $n (hasKey $units $unit)) -}}
{{- fail (printf "%s %s: the chart reads a whole number of bytes with at most a suffix Ki, Mi, Gi, Ti, Pi, k, M, G, T or P (e.g. 50Gi, 500G, 53687091200), not %q" $name $q $q) -}}
{{- end -}}
{{- mul (int64 $n) (int64 (get $units $unit)) -}}
{{- end -}}
{{- end -}}

{{/* The stager's hard cache limit: limitBytes as given, else 98% of the emptyDir's sizeLimit (none for a hostPath),
never below the budget; "" for none. */}}
{{- define "lorafleet.cacheLimitBytes" -}}
{{- $c := .Values.worker.adapterCache -}}
{{- $budget := int64 $c.sizeBytes -}}
{{- if not (kindIs "invalid" $c.limitBytes) -}}
{{- if lt (int64 $c.limitBytes) $budget -}}
{{- fail "worker.adapterCache.limitBytes must be at least sizeBytes (the budget is kept below the limit)" -}}
{{- end -}}
{{- int64 $c.limitBytes -}}
{{- else if and (not $c.hostPath) $c.sizeLimit -}}
{{- $size := include "lorafleet.quantityBytes" (list $c.sizeLimit "worker.adapterCache.sizeLimit") | int64 -}}
{{- if gt $size 0 -}}{{ max $budget (div (mul $size 98) 100) }}{{- end -}}
{{- end -}}
{{- end -}}

{{/* The engine's resources: worker.resources, less the GPU for worker.device=cpu (a pod that never uses it would
wait for a free one). */}}
{{- define "lorafleet.workerResources" -}}
{{- $resources := deepCopy (.Values.worker.resources | default dict) -}}
{{- if eq .Values.worker.device "cpu" -}}
{{- range $key := list "requests" "limits" -}}
{{- with get $resources $key -}}{{- $_ := set $resources $key (omit . "nvidia.com/gpu") -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{/* The stager's resources: worker.stagerResources, requesting the emptyDir cache's sizeLimit of ephemeral storage
unless they request or limit it themselves (a limit is the request too; one below the request refuses the pod).
The scheduler then places the pod where the cache fits, instead of a node whose disk fills and evicts it. */}}
{{- define "lorafleet.stagerResources" -}}
{{- $resources := deepCopy (.Values.worker.stagerResources | default dict) -}}
{{- $cache := .Values.worker.adapterCache -}}
{{- if and (not $cache.hostPath) $cache.sizeLimit -}}
{{- $requests := $resources.requests | default dict -}}
{{- if not (or (hasKey $requests "ephemeral-storage") (hasKey ($resources.limits | default dict) "ephemeral-storage")) -}}
{{- $_ := set $requests "ephemeral-storage" $cache.sizeLimit -}}
{{- $_ := set $resources "requests" $requests -}}
{{- end -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{- define "lorafleet.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "lorafleet.adminTokenSecret" -}}
{{ .Values.secrets.existingAdminTokenSecret | default (printf "%s-admin-token" (include "lorafleet.fullname" .)) }}
{{- end -}}
{{- define "lorafleet.stagerTokenSecret" -}}
{{ .Values.secrets.existingStagerTokenSecret | default (printf "%s-stager-token" (include "lorafleet.fullname" .)) }}
{{- end -}}
{{- define "lorafleet.apiKeysSecret" -}}
{{ .Values.secrets.existingApiKeysSecret | default (printf "%s-api-keys" (include "lorafleet.fullname" .)) }}
{{- end -}}
{{- define "lorafleet.objectStoreSecret" -}}
{{ .Values.objectStore.existingSecret | default (printf "%s-object-store" (include "lorafleet.fullname" .)) }}
{{- end -}}

{{/* A token kept across upgrades: the value given, else the one already in the cluster, else a new one. */}}
{{- define "lorafleet.token" -}}
{{- $given := index . 0 -}}{{- $ctx := index . 1 -}}{{- $name := index . 2 -}}
{{- if $given -}}{{ $given | b64enc }}
{{- else -}}
{{- $existing := lookup "v1" "Secret" $ctx.Release.Namespace $name -}}
{{- if and $existing $existing.data $existing.data.token -}}{{ $existing.data.token }}
{{- else -}}{{ randAlphaNum 40 | b64enc }}{{- end -}}
{{- end -}}
{{- end -}}

{{/* The readiness gate on the first push, for the engine and its sidecar alike (worker.readyAfterPush; null:
on when this release runs the operator). */}}
{{- define "lorafleet.readinessGate" -}}
{{- $gated := .Values.worker.readyAfterPush -}}
{{- if kindIs "invalid" $gated }}{{ $gated = .Values.operator.enabled }}{{ end -}}
- {name: LORAFLEET_READY_AFTER_PUSH, value: {{ $gated | quote }}}
{{- if not (kindIs "invalid" .Values.worker.readyWithoutPushSeconds) }}
- {name: LORAFLEET_READY_WITHOUT_PUSH_S, value: {{ .Values.worker.readyWithoutPushSeconds | quote }}}
{{- end }}
{{- end }}
