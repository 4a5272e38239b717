// Draws a report's three charts from the JSON the page embeds (json_script: no HTML injection).
(function () {
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const money = (v) => `${v.toFixed(4)} ${data.currency}`;
  const hourly = data.series.length > 1 && new Date(data.series[1].at) - new Date(data.series[0].at) <= 3600e3;
  const label = (iso) => (hourly ? iso.slice(11, 16) : iso.slice(0, 10));

  new Chart(document.getElementById("chart-cost"), {
    type: "line",
    data: {
      labels: data.series.map((p) => label(p.at)),
      datasets: [{ label: `cost (${data.currency})`, data: data.series.map((p) => p.cost), tension: 0.2 }],
    },
    options: { plugins: { tooltip: { callbacks: { label: (c) => money(c.parsed.y) } } } },
  });

  const models = Object.entries(data.by_model).filter(([, r]) => r.cost_per_million_tokens !== null);
  new Chart(document.getElementById("chart-models"), {
    type: "bar",
    data: {
      labels: models.map(([name]) => name),
      datasets: [{ label: `${data.currency} per million tokens`, data: models.map(([, r]) => r.cost_per_million_tokens) }],
    },
  });

  const nodes = Object.entries(data.by_node);
  new Chart(document.getElementById("chart-nodes"), {
    type: "bar",
    data: {
      labels: nodes.map(([name]) => name),
      datasets: [{ label: "utilisation (%)", data: nodes.map(([, r]) => Math.round(r.utilisation * 1000) / 10) }],
    },
    options: { scales: { y: { min: 0, max: 100 } } },
  });
  document.body.dataset.chartsReady = "true";
})();
