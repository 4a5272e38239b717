// The fleet page's charts: the last hour per deployment, fed by the console socket (the whole
// hour when it opens, then each point beat takes). One colour per deployment on every chart.
const LFCharts = (() => {
  const PALETTE = ["#2f5bd3", "#1e8a5a", "#d3752f", "#8a3fd1", "#c2185b", "#00838f", "#7a6a00", "#5d4037"];
  const colours = {};
  const colour = (name) => (colours[name] ??= PALETTE[Object.keys(colours).length % PALETTE.length]);
  const HOUR = 3600e3;
  let points = [];
  const charts = {};

  // Each chart: which figures it draws, how (line or bars), and the dashes telling them apart.
  const SPECS = {
    "chart-throughput": { unit: "tokens/s", lines: [["tokens_per_s", ""]] },
    "chart-ttft": { unit: "ms", lines: [["ttft_p50_ms", "p50"], ["ttft_p95_ms", "p95", [6, 4]]] },
    "chart-load": { unit: "requests", lines: [["in_flight", "in flight"], ["queue", "queued", [6, 4]]] },
    "chart-replicas": { unit: "replicas", lines: [["replicas", "ready"], ["desired", "desired", [2, 3]]], stepped: true },
    "chart-errors": { unit: "errors per 10 s", lines: [["errors", ""]], bar: true },
  };

  function datasets(spec) {
    const names = [...new Set(points.flatMap((p) => Object.keys(p.deployments)))].sort();
    return names.flatMap((name) => spec.lines.map(([field, what, dash]) => ({
      label: what ? `${name} ${what}` : name,
      data: points.map((p) => ({ x: p.t * 1000, y: p.deployments[name] ? p.deployments[name][field] : null })),
      borderColor: colour(name),
      backgroundColor: colour(name),
      borderDash: dash || [],
      pointRadius: points.length < 30 ? 2 : 0, // a line needs a few points to be seen
      borderWidth: 1.5,
      stepped: spec.stepped || false,
      spanGaps: false,
    })));
  }

  function draw() {
    const now = Date.now();
    for (const [id, spec] of Object.entries(SPECS)) {
      const canvas = document.getElementById(id);
      if (!canvas) continue;
      const data = { datasets: datasets(spec) };
      if (charts[id]) {
        charts[id].data = data;
        charts[id].options.scales.x.min = now - HOUR;
        charts[id].options.scales.x.max = now;
        charts[id].update("none");
        continue;
      }
      charts[id] = new Chart(canvas, {
        type: spec.bar ? "bar" : "line",
        data,
        options: {
          animation: false,
          maintainAspectRatio: false,
          parsing: false,
          normalized: true,
          scales: {
            x: { type: "linear", min: now - HOUR, max: now, ticks: { maxTicksLimit: 7, callback: (v) => new Date(v).toTimeString().slice(0, 5) } },
            y: { beginAtZero: true, title: { display: true, text: spec.unit } },
          },
          plugins: { legend: { labels: { boxWidth: 12 } }, tooltip: { callbacks: { title: (items) => new Date(items[0].parsed.x).toLocaleTimeString() } } },
        },
      });
    }
  }

  // A socket message: {series: [points], reset: true} for the hour, {series: [point]} after.
  function receive(msg) {
    points = msg.reset ? msg.series : points.concat(msg.series);
    const floor = Date.now() / 1000 - 3600;
    points = points.filter((p) => p.t >= floor);
    draw();
  }

  return { receive, colour, points: () => points };
})();
