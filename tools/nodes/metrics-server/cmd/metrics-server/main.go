// Command metrics-server is the upstream metrics-server, unchanged: it serves
// metrics.k8s.io from the kubelets' resource metrics.
package main

import (
	"os"
	"runtime"

	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/component-base/logs"

	"sigs.k8s.io/metrics-server/cmd/metrics-server/app"
)

func main() {
	logs.InitLogs()
	defer logs.FlushLogs()
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(runtime.NumCPU())
	}
	if err := app.NewMetricsServerCommand(genericapiserver.SetupSignalHandler()).Execute(); err != nil {
		logs.FlushLogs()
		os.Exit(1)
	}
}
