{{- define "llamafleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "llamafleet.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "llamafleet.labels" -}}
{{ include "llamafleet.selector" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "llamafleet.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "llamafleet.secretName" -}}
{{ .Values.secrets.existingSecret | default (printf "%s-secrets" (include "llamafleet.fullname" .)) }}
{{- end -}}

{{- define "llamafleet.tlsSecretName" -}}
{{ .Values.tls.existingSecret | default (printf "%s-ca" (include "llamafleet.fullname" .)) }}
{{- end -}}

{{- define "llamafleet.webUrl" -}}
http://{{ include "llamafleet.fullname" . }}-web:{{ .Values.web.service.port }}
{{- end -}}

{{/* Environment of every LlamaFleet process: settings from the ConfigMap, keys from the Secret. */}}
{{- define "llamafleet.env" -}}
{{- range $key := list "LLAMAFLEET_SECRET_KEY" "LLAMAFLEET_NODE_TOKEN" "DATABASE_URL" "REDIS_URL" }}
- name: {{ $key }}
  valueFrom: {secretKeyRef: {name: {{ include "llamafleet.secretName" $ }}, key: {{ $key }}}}
{{- end }}
{{- range $key := list "LLAMAFLEET_METRICS_TOKEN" "HF_TOKEN" }}
- name: {{ $key }}
  valueFrom: {secretKeyRef: {name: {{ include "llamafleet.secretName" $ }}, key: {{ $key }}, optional: true}}
{{- end }}
{{- end -}}

{{/* The certificate the certificate init container issued (gRPC to and between agents). */}}
{{- define "llamafleet.tlsEnv" -}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: LLAMAFLEET_TLS_CA
  value: /pki/ca.pem
- name: LLAMAFLEET_TLS_CERT
  value: /pki/pod.pem
- name: LLAMAFLEET_TLS_KEY
  value: /pki/pod-key.pem
{{- end -}}

{{/* Issues this pod's certificate from the cluster CA, for its pod IP, into the /pki emptyDir. */}}
{{- define "llamafleet.certificateInit" -}}
- name: certificate
  image: {{ include "llamafleet.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [sh, -c]
  args:
    - >-
      cp /ca/ca.pem /ca/ca-key.pem /pki/ &&
      python -m workers pki --dir /pki --name pod --host "$POD_IP" --host "$NODE_NAME" &&
      rm /pki/ca-key.pem
  env:
    - name: POD_IP
      valueFrom: {fieldRef: {fieldPath: status.podIP}}
    - name: NODE_NAME
      valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
  securityContext: {allowPrivilegeEscalation: false}
  volumeMounts:
    - {name: ca, mountPath: /ca, readOnly: true}
    - {name: pki, mountPath: /pki}
{{- end -}}

{{/* Control-plane pods start once the migration Job has brought the schema up to date. */}}
{{- define "llamafleet.waitForMigrations" -}}
- name: wait-for-migrations
  image: {{ include "llamafleet.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [sh, -c, "until python manage.py migrate --check >/dev/null; do echo waiting for migrations; sleep 3; done"]
  envFrom:
    - configMapRef: {name: {{ include "llamafleet.fullname" . }}-config}
  env:
    {{- include "llamafleet.env" . | nindent 4 }}
  securityContext: {allowPrivilegeEscalation: false}
{{- end -}}

{{- define "llamafleet.controlPlaneVolumes" -}}
- name: ca
  secret: {secretName: {{ include "llamafleet.tlsSecretName" . }}}
- name: pki
  emptyDir: {}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.modelStore.existingClaim | default (printf "%s-models" (include "llamafleet.fullname" .)) }}
{{- end -}}

{{- define "llamafleet.controlPlaneMounts" -}}
- {name: pki, mountPath: /pki, readOnly: true}
- {name: models, mountPath: /data/models}
{{- end -}}

{{- define "llamafleet.podSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  fsGroup: 10001
  seccompProfile: {type: RuntimeDefault}
{{- end -}}
