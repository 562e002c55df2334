// powersgd: being written (issue 3)
