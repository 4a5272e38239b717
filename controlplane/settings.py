"""Settings: every value read from the environment here, strictly parsed.

Embedded defaults run the whole stack on one machine: SQLite under var/ and Redis on
127.0.0.1:6379. Secrets have no default: a missing one stops the process at start with
the variable's name.
"""

import hashlib
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from workers.tls import TLSFiles

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env()
VAR_DIR = Path(env.str("LLAMAFLEET_VAR_DIR", default=str(BASE_DIR / "var")))


def _required(name: str) -> str:
    value = env.str(name, default="")
    if not value:
        raise ImproperlyConfigured(
            f"{name} is not set. Export it (make run writes one to var/env for you)."
        )
    return value


DEBUG = env.bool("LLAMAFLEET_DEBUG", default=False)
SECRET_KEY = _required("LLAMAFLEET_SECRET_KEY")
#: Shared secret of agents and the control plane, for heartbeats, downloads and gRPC.
NODE_TOKEN = _required("LLAMAFLEET_NODE_TOKEN")
#: Mutual TLS to agents under the cluster CA (LLAMAFLEET_TLS_CA/_CERT/_KEY); None: plaintext,
#: and only to agents on loopback.
AGENT_TLS = TLSFiles.from_env()
#: Tokens a request without max_tokens reserves against its token quotas until it ends.
QUOTA_RESERVE_TOKENS = env.int("LLAMAFLEET_QUOTA_RESERVE_TOKENS", default=256)
#: Read-only token for Prometheus: /metrics of the control plane and of agents, nothing else.
METRICS_TOKEN = env.str("LLAMAFLEET_METRICS_TOKEN", default="")
ALLOWED_HOSTS = env.list("LLAMAFLEET_ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env.list("LLAMAFLEET_CSRF_TRUSTED_ORIGINS", default=[])

# HTTPS. `make run` serves plain HTTP on loopback; behind a TLS proxy set LLAMAFLEET_HTTPS=true
# (secure cookies, HSTS, redirect) and LLAMAFLEET_TRUST_PROXY=true if the proxy sets
# X-Forwarded-Proto (only then: a client could send that header itself).
HTTPS = env.bool("LLAMAFLEET_HTTPS", default=False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = HTTPS
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = CSRF_COOKIE_SAMESITE = "Lax"
SECURE_HSTS_SECONDS = env.int("LLAMAFLEET_HSTS_SECONDS", default=31536000 if HTTPS else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("LLAMAFLEET_HSTS_SUBDOMAINS", default=False)
SECURE_SSL_REDIRECT = env.bool("LLAMAFLEET_SSL_REDIRECT", default=HTTPS)
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]  # probes speak plain HTTP inside the cluster
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
if env.bool("LLAMAFLEET_TRUST_PROXY", default=False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    USE_X_FORWARDED_HOST = True

DATABASES = {
    "default": env.db_url("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'llamafleet.sqlite3'}")
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    # Several processes write (web, worker, beat). IMMEDIATE transactions take the write
    # lock up front, so a writer waits (timeout) instead of failing with "database is
    # locked" when a read transaction would have to upgrade; WAL lets readers go on.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "timeout": 20,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    )
    # Tests run Celery workers in threads: an in-memory database's table locks would not
    # wait, a file with the settings above does.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test-db.sqlite3")}
DATABASES["default"]["CONN_MAX_AGE"] = env.int("LLAMAFLEET_DB_CONN_MAX_AGE", default=0)
# A connection is checked before use (with the pool: as it leaves the pool), so after
# PostgreSQL restarts no request fails on a connection the restart closed.
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
if DATABASES["default"]["ENGINE"].endswith("postgresql") and env.bool(
    "LLAMAFLEET_DB_POOL", default=True
):
    # Under ASGI every request would otherwise open a connection of its own (psycopg_pool).
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": env.int("LLAMAFLEET_DB_POOL_SIZE", default=10),
        "timeout": 10,
        # psycopg_pool retries a lost connection with a delay it doubles each time (1, 2,
        # 4 ... s) for reconnect_timeout (5 min by default): after a 30-s outage the next
        # try could come 32 s after PostgreSQL was back, and every request of that web
        # process failed meanwhile (seen in the fault battery). Given up after 5 s instead,
        # the next request that finds no connection starts a new try at once.
        "reconnect_timeout": 5,
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")
#: Every Redis key of this stack (Celery's queues, the channel layer, routing counters, quotas)
#: starts with this, so two stacks sharing one Redis database never consume each other's
#: tasks. By default one per var directory; give every process of one stack the same value.
REDIS_NAMESPACE = env.str(
    "LLAMAFLEET_NAMESPACE",
    default="llamafleet-" + hashlib.sha256(str(VAR_DIR.resolve()).encode()).hexdigest()[:8],
)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "channels",
    "apps.accounts",
    "apps.nodes",
    "apps.catalog",
    "apps.deployments",
    "apps.serving",
    "apps.usage",
    "apps.console",
    "django_celery_beat",
]

# Django's own middleware, run on the event loop where it does no I/O
# (controlplane.middleware._Inline): on an async request each sync hook was a thread hop.
MIDDLEWARE = [
    "controlplane.middleware.RequestLimitsMiddleware",
    "controlplane.middleware.SecurityMiddleware",
    "controlplane.middleware.StaticFilesMiddleware",  # the console's and the admin's files
    "controlplane.middleware.SessionMiddleware",
    "controlplane.middleware.CommonMiddleware",
    "controlplane.middleware.CsrfViewMiddleware",
    "controlplane.middleware.AuthenticationMiddleware",
    "controlplane.middleware.MessageMiddleware",
    "controlplane.middleware.XFrameOptionsMiddleware",
]

#: Largest request body (bytes); larger ones get 413. Prompts up to a long context fit easily.
DATA_UPLOAD_MAX_MEMORY_SIZE = env.int("LLAMAFLEET_MAX_BODY_BYTES", default=8 * 1024 * 1024)

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
WHITENOISE_USE_FINDERS = True  # served from the apps' static/ folders: no collectstatic step
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # where collectstatic would put them
LOGIN_URL = "console:login"
LOGIN_REDIRECT_URL = "console:dashboard"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "apps.accounts.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # Every view names its role (apps/accounts/permissions.py); one that does not is closed.
    "DEFAULT_PERMISSION_CLASSES": ["apps.accounts.permissions.Undeclared"],
    "DEFAULT_PARSER_CLASSES": ["controlplane.parsers.StrictJSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "controlplane.errors.exception_handler",
    "DEFAULT_PAGINATION_CLASS": "controlplane.pagination.BoundedLimitOffsetPagination",
    "PAGE_SIZE": 100,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "LlamaFleet API",
    "DESCRIPTION": "Nodes, models, deployments and OpenAI-compatible inference.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "OAS_VERSION": "3.1.0",  # JSON Schema 2020-12, as pydantic writes the /v1 bodies
    "SERVE_PERMISSIONS": ["apps.accounts.permissions.IsApplication"],
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "apps.serving.openapi.add_openai_endpoints",
    ],
}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # channels-redis blocks 5 s per read (BZPOPMIN) and redis-py's default socket timeout
        # is also 5 s: a longer one keeps idle sockets from failing with a TimeoutError.
        "CONFIG": {
            "hosts": [{"address": REDIS_URL, "socket_timeout": 30}],
            "prefix": f"{REDIS_NAMESPACE}:asgi",
        },
    }
}

# Celery: one queue per task family, explicit time limits (checked by a test).
CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default=REDIS_URL)
CELERY_RESULT_BACKEND = None
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "global_keyprefix": f"{REDIS_NAMESPACE}:",
    # Bounded sockets: a Redis that accepts but never answers (stopped, or behind a dead
    # proxy) gives an error after 5 s, not a publish or a reconnect that waits forever.
    "socket_timeout": 5.0,
    "socket_connect_timeout": 5.0,
}
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_CONSUMER = "controlplane.celery:Consumer"  # survives a broker restart
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_TASK_ROUTES = {
    # Periodic checks must not wait behind a backlog of loads or an hour-long pull: their own
    # queue, which the worker serves alongside the others.
    "apps.nodes.tasks.sweep_stale_nodes": {"queue": "liveness"},
    "apps.deployments.tasks.autoscale": {"queue": "liveness"},
    "apps.deployments.tasks.expire_load_leases": {"queue": "liveness"},
    "apps.catalog.tasks.expire_job_leases": {"queue": "liveness"},
    "apps.console.tasks.record_series": {"queue": "liveness"},
    "apps.nodes.tasks.expire_link_job_leases": {"queue": "liveness"},
    "apps.nodes.tasks.measure_links": {"queue": "jobs"},  # minutes of transfers
    "apps.catalog.tasks.*": {"queue": "jobs"},
    "apps.deployments.tasks.*": {"queue": "control"},
    "apps.nodes.tasks.*": {"queue": "control"},
    "apps.usage.tasks.*": {"queue": "jobs"},
}
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
#: Schedules live in the database (django-celery-beat): editable in the admin. Intervals that
#: apps declare with controlplane.celery.every() are copied there when beat starts.
CELERY_BEAT_SCHEDULER = "controlplane.beat:Scheduler"
CELERY_TASK_ALWAYS_EAGER = env.bool("LLAMAFLEET_CELERY_EAGER", default=False)

# Fleet behaviour.
MODEL_STORE_DIR = Path(env.str("LLAMAFLEET_MODEL_STORE", default=str(VAR_DIR / "models")))
#: A node whose last heartbeat is older than this is marked unreachable.
HEARTBEAT_TIMEOUT_SECONDS = env.int("LLAMAFLEET_HEARTBEAT_TIMEOUT", default=20)
#: Base URL agents use to download model files from this control plane.
# Hugging Face pulls: the hub (or a mirror, as huggingface_hub's HF_ENDPOINT) and a token for
# gated or private repositories. The token is a secret: it is redacted from logs.
HF_ENDPOINT = env.str("HF_ENDPOINT", default="https://huggingface.co").rstrip("/")
HF_TOKEN = env.str("HF_TOKEN", default="")
# A quantization job's whole call to its agent (quantize, measure, send the file), seconds.
QUANTIZE_TIMEOUT = env.float("LLAMAFLEET_QUANTIZE_TIMEOUT", default=3600.0)
PUBLIC_URL = env.str("LLAMAFLEET_PUBLIC_URL", default="http://127.0.0.1:8000")
DEFAULT_CONTEXT_LENGTH = env.int("LLAMAFLEET_DEFAULT_CONTEXT", default=2048)
DEFAULT_PARALLEL = env.int("LLAMAFLEET_DEFAULT_PARALLEL", default=4)
#: rpc servers of split deployments listen from this port up on their stage nodes.
RPC_PORT_BASE = env.int("LLAMAFLEET_RPC_PORT_BASE", default=50052)

# Serving.
#: Generations one control-plane process streams at once; beyond it requests get a fast 429.
MAX_IN_FLIGHT = env.int("LLAMAFLEET_MAX_IN_FLIGHT", default=256)
#: Longest a generation may run, queueing included, before it ends with a timeout error.
REQUEST_TIMEOUT_SECONDS = env.float("LLAMAFLEET_REQUEST_TIMEOUT", default=600.0)
#: How long a web process trusts its cached table of ready replicas (changes made in this
#: process clear it at once).
ROUTING_CACHE_SECONDS = env.float("LLAMAFLEET_ROUTING_CACHE_SECONDS", default=1.0)
#: How long a web process trusts an API key it checked, without asking the database again
#: (a key revoked, or its owner deactivated, through this process is refused at once).
KEY_CACHE_SECONDS = env.float("LLAMAFLEET_KEY_CACHE_SECONDS", default=1.0)
#: Times one stream may move to another replica after its replica fails mid-flight.
#: A request for a model scaled to zero waits this long for a first replica (SSE comments
#: keep a stream's connection open meanwhile), then gets 503 with Retry-After; beyond
#: COLD_START_MAX_WAITING waiting requests per model, 503 at once.
COLD_START_TIMEOUT = env.float("LLAMAFLEET_COLD_START_TIMEOUT", default=180.0)
COLD_START_MAX_WAITING = env.int("LLAMAFLEET_COLD_START_MAX_WAITING", default=256)
MAX_MIGRATIONS = env.int("LLAMAFLEET_MAX_MIGRATIONS", default=2)

# Costs: reports are in this currency; nodes priced in another are listed, not added.
BILLING_CURRENCY = env.str("LLAMAFLEET_CURRENCY", default="USD")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "filters": {"redact": {"()": "controlplane.logs.RedactSecrets"}},
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "filters": ["redact"],
        }
    },
    "root": {"handlers": ["console"], "level": env.str("LLAMAFLEET_LOG_LEVEL", default="INFO")},
}
